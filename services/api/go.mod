module github.com/better-compute/better-compute/services/api

go 1.26.0

replace (
	github.com/better-compute/better-compute/api => ../../api
	github.com/better-compute/better-compute/pkg => ../../pkg
)
