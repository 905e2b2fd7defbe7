module tracejoin.dev/tests/goh2c

go 1.26.0

require golang.org/x/net v0.62.0

require golang.org/x/text v0.43.0 // indirect
