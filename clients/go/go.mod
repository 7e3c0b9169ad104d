module github.com/genserve/genserve/clients/go

go 1.21

require (
	google.golang.org/grpc v1.64.0
	google.golang.org/protobuf v1.36.5
)

require (
	golang.org/x/net v0.27.0 // indirect
	golang.org/x/sys v0.22.0 // indirect
	golang.org/x/text v0.22.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20240318140521-94a12d6c2237 // indirect
)
