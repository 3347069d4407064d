module github.com/better-compute/better-compute/tests

go 1.26.0

replace (
	github.com/better-compute/better-compute/api => ../api
	github.com/better-compute/better-compute/cmd/better-compute => ../cmd/better-compute
	github.com/better-compute/better-compute/pkg => ../pkg
	github.com/better-compute/better-compute/services/api => ../services/api
	github.com/better-compute/better-compute/services/joinservice => ../services/joinservice
	github.com/better-compute/better-compute/services/gateway => ../services/gateway
	github.com/better-compute/better-compute/services/scheduler => ../services/scheduler
	github.com/better-compute/better-compute/services/controllers => ../services/controllers
	github.com/better-compute/better-compute/services/fakedaemon => ../services/fakedaemon
)
