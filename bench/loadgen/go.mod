module tracejoin.dev/bench/loadgen

go 1.22
