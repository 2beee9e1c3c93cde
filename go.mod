module github.com/p2pcomm/p2pcomm

go 1.24.0

require (
	github.com/emer/empi/v2 v2.0.0-dev0.0.5 // indirect
	golang.org/x/sys v0.38.0 // indirect
)
