-- wrk script: every request carries its own W3C traceparent (unique trace id and parent id,
-- sampled), so every request is one tracejoin traces. Prints one "JSON {...}" line at the end
-- with the counts and latency percentiles (µs) that bench/measure.py reads.
local seq = 0
local hi1, hi2

function init(args)
  -- a per-thread random prefix: trace ids stay unique across threads and runs
  math.randomseed(os.time() + math.floor(os.clock() * 1e6) + tonumber(tostring({}):sub(8), 16))
  hi1 = math.random(1, 0x7fffffff)
  hi2 = math.random(0, 0x7fffffff)
end

-- The low 8 bytes are random, as an SDK's are: a TraceIdRatioBased sampler (and tracejoin's CPU
-- budget, which decides as it does) compares them with ratio x 2^64, so a counter there would
-- be kept at every ratio. Uniqueness comes from the upper half (thread prefix, counter).
local function rand32()
  return math.floor(math.random() * 0x100000000)
end

request = function()
  seq = seq + 1
  local tp = string.format("00-%08x%08x%08x%08x-%08x%08x-01",
    hi1, seq % 0x100000000, rand32(), rand32(), hi2, seq % 0x100000000 + 1)
  return wrk.format(nil, nil, { ["traceparent"] = tp })
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'JSON {"requests": %d, "duration_us": %d, "bytes": %d, ' ..
    '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}, ' ..
    '"latency_us": {"p50": %d, "p90": %d, "p99": %d, "p999": %d, "max": %d, "mean": %.1f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max, latency.mean))
end
