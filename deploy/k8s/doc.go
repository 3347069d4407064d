// Package k8s holds the tests of the Kubernetes manifests beside it
// (deploy/k8s: the kustomize base, the staging overlay and the sim-fleet
// component); docs/deploy.md says how to run them against a cluster.
package k8s
