module tracejoin.dev/tests/goserver

go 1.22
