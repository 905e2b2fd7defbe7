// A Node.js http server the tests control: `node nodeserver.js PORT`. Prints "ready" once
// listening.
//   /chunks?n=N    a chunked response of N chunks written in one tick (Node corks them into
//                  one writev: each chunk is a size line, the data and a CRLF, as iovecs)
//   /drip?n=N      N chunks, one per event-loop turn (a writev per chunk)
// Chunk data are CSV rows ending in ",0\r\n": a chunk's last bytes look like the terminator.
//   anything else  200 "ok\n" with Content-Length
'use strict';
const http = require('http');

const server = http.createServer((req, res) => {
  const url = new URL(req.url, 'http://x');
  const n = parseInt(url.searchParams.get('n') || '3', 10);
  req.resume();
  req.on('end', () => {
    if (url.pathname === '/chunks') {
      res.writeHead(200, { 'Content-Type': 'text/plain' });
      for (let i = 0; i < n; i++) res.write(`row ${i},0\r\n`);
      res.end();
    } else if (url.pathname === '/drip') {
      res.writeHead(200, { 'Content-Type': 'text/plain' });
      let i = 0;
      const next = () => {
        if (i === n) return res.end();
        res.write(`row ${i++},0\r\n`);
        setImmediate(next);
      };
      next();
    } else {
      res.writeHead(200, { 'Content-Type': 'text/plain', 'Content-Length': 3 });
      res.end('ok\n');
    }
  });
});
server.keepAliveTimeout = 30000;
server.listen(parseInt(process.argv[2], 10), '127.0.0.1', () => console.log('ready'));
