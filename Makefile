# better-compute: `make up` runs the product, `make test` runs the tests.
# `make help` lists every target.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

GO ?= go
# Every Go module of the workspace, in dependency order.
MODULES := api pkg pkg/devstack services/api services/joinservice services/gateway services/scheduler \
	services/controllers services/fakedaemon cmd/better-compute deploy/k8s tests
SERVICES := api joinservice gateway scheduler controllers fakedaemon
BIN := bin/linux
TOOLS := bin/tools
FLEET ?= 8

# No buildx here: the classic builder, for docker and for compose v1.
export DOCKER_BUILDKIT := 0
export COMPOSE_DOCKER_CLI_BUILD := 0
export COMPOSE_PROJECT_NAME ?= better-compute
# Ryuk's image cannot be pulled; tests terminate their own containers.
export TESTCONTAINERS_RYUK_DISABLED := true
COMPOSE := $(shell if docker compose version >/dev/null 2>&1; then echo "docker compose"; else echo docker-compose; fi)

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(TOOLS)/.stamp: tools/go.mod tools/go.sum
	@mkdir -p $(TOOLS)
	cd tools && GOWORK=off $(GO) build -o ../$(TOOLS)/ github.com/bufbuild/buf/cmd/buf \
		google.golang.org/protobuf/cmd/protoc-gen-go connectrpc.com/connect/cmd/protoc-gen-connect-go \
		github.com/golangci/golangci-lint/v2/cmd/golangci-lint
	@touch $@

.PHONY: tools
tools: $(TOOLS)/.stamp ## Build the pinned tools (buf, protoc plugins, golangci-lint) into bin/tools.

# What make generate writes: the protobuf code and the generated references.
GENERATED := api/gen docs/cli.md docs/configuration.md docs/metrics.md

.PHONY: generate
generate: tools ## Regenerate the protobuf code in api/gen, the CLI reference docs/cli.md, the configuration reference docs/configuration.md and the metrics reference docs/metrics.md.
	cd api && PATH="$(CURDIR)/$(TOOLS):$$PATH" buf lint proto && PATH="$(CURDIR)/$(TOOLS):$$PATH" buf generate
	$(GO) run ./cmd/better-compute/internal/gendocs docs/cli.md
	$(GO) run ./cmd/better-compute/internal/genconfig docs/configuration.md
	$(GO) run ./cmd/better-compute/internal/genmetrics docs/metrics.md

.PHONY: generate-check
generate-check: generate ## Fail when api/gen, docs/cli.md, docs/configuration.md or docs/metrics.md differ from what make generate writes.
	@git diff --exit-code --stat -- $(GENERATED) || { echo "$(GENERATED): stale: run make generate and commit"; exit 1; }
	@test -z "$$(git status --porcelain -- $(GENERATED))" || { git status --porcelain -- $(GENERATED); echo "untracked generated files: run make generate and commit"; exit 1; }

# The wire format only grows compatibly: the protos against the previous
# commit's, with buf's FILE rules (a removed field must leave its number and
# name reserved, in a commit of its own that this check then reads as the
# base). Skipped, saying so, in a clone without the previous commit.
.PHONY: breaking
breaking: tools ## Fail when the protos changed incompatibly since the previous commit (buf breaking).
	@if git rev-parse -q --verify HEAD~1 >/dev/null; then \
		cd api/proto && PATH="$(CURDIR)/$(TOOLS):$$PATH" buf breaking --against "$(CURDIR)/.git#ref=HEAD~1,subdir=api/proto"; \
	else echo "breaking: no previous commit here (shallow clone?): skipped"; fi

.PHONY: vet
vet: ## go vet every module.
	@fail=0; for m in $(MODULES); do echo "vet $$m"; (cd $$m && $(GO) vet ./...) || fail=1; done; exit $$fail

.PHONY: lint
lint: tools ## golangci-lint every module, the one-clock rule, the docs citation rule, and tidy go.mod files.
	@for m in $(MODULES); do echo "lint $$m"; (cd $$m && "$(CURDIR)/$(TOOLS)/golangci-lint" run --allow-parallel-runners --config "$(CURDIR)/.golangci.yml" ./...) || exit 1; done
	scripts/lint-clock.sh
	scripts/lint-docs.sh
	@for m in $(MODULES); do (cd $$m && GOWORK=off $(GO) mod tidy -diff >/dev/null) || { echo "$$m: go.mod is not tidy: cd $$m && GOWORK=off go mod tidy"; exit 1; }; done

.PHONY: build
build: ## Build static binaries of every service and the CLI into bin/linux.
	@mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='-s -w' -o $(BIN)/ $(addprefix ./services/,$(SERVICES))
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='-s -w' -o $(BIN)/better-compute ./cmd/better-compute

# The version tag of the service images: `git describe` of the work tree
# (`make images TAG=v1.2.3` names another; BETTER_COMPUTE_IMAGE_TAG, which
# compose.yaml reads, too). Each is also tagged dev, compose's and the tests'
# default (scripts/images.sh).
TAG ?= $(or $(BETTER_COMPUTE_IMAGE_TAG),$(shell git describe --tags --always --dirty 2>/dev/null),dev)

.PHONY: images
images: build ## Build every image compose and the tests need (no registry: postgres, nats, services), the services' tagged TAG (git describe) and dev.
	BETTER_COMPUTE_IMAGE_TAG=$(TAG) scripts/images.sh all

# The observability profile (OBS=1): Prometheus and Jaeger beside the stack,
# every service and fakedaemon exporting its spans to Jaeger
# (docs/compose.md).
OBS ?=
OBS_COMPOSE := $(if $(OBS),--profile observability)
OBS_ENV := $(if $(OBS),OTEL_EXPORTER_OTLP_ENDPOINT=http://jaeger:4318)

.PHONY: images-obs
images-obs: ## Build the images of compose's observability profile (prometheus, jaeger; from their Go modules, many minutes the first time).
	scripts/images.sh observability

.PHONY: up
up: images $(if $(OBS),images-obs) ## Build what is missing, start the stack with FLEET (8) fakedaemons (OBS=1: with Prometheus and Jaeger), wait for adoption, print the CLI's env.
	$(OBS_ENV) $(COMPOSE) $(OBS_COMPOSE) up -d --scale fakedaemon=$(FLEET)
	scripts/wait-fleet.sh $(FLEET)

SIM ?= 8
.PHONY: dev
dev: ## Run the control plane in one process with SIM (8) simulated machines and a throwaway database (no Docker).
	$(GO) run ./cmd/better-compute dev --memory --sim $(SIM)

.PHONY: down
down: ## Stop the stack (with the observability profile's services) and delete its volumes.
	$(COMPOSE) --profile observability down -v --remove-orphans

.PHONY: ps
ps: ## Show the stack's containers.
	$(COMPOSE) ps

# Unit and integration tests of every module except tests/ (real Postgres in
# containers via testcontainers, embedded NATS), with the race detector.
.PHONY: test-unit
test-unit: images
	@fail=0; for m in $(filter-out tests,$(MODULES)); do echo "test $$m"; (cd $$m && $(GO) test -race -count=1 -timeout 10m ./...) || { echo "FAIL: tests of $$m"; fail=1; }; done; exit $$fail

# The suites of tests/: services in process against Postgres and NATS
# containers, and the compose fleet end to end.
.PHONY: test-e2e
test-e2e: images images-obs
	cd tests && $(GO) test -race -count=1 -timeout 20m ./...

# Each fuzz test runs for FUZZTIME (go test -fuzz takes one target at a
# time: 14 targets, 210 s at the default; scripts/fuzz.sh runs one again
# after Go 1.26's bare deadline failure, which finds nothing); its seed corpus and the
# crashers kept in testdata/fuzz also run as plain tests in test-unit. A new
# decoder of network input gets its target and a line here.
FUZZTIME ?= 15s
.PHONY: fuzz
fuzz: ## Run the fuzz tests of the network decoders (join request and response, session messages and their framing, renewals, CSRs, pins, gateway URLs, well-known document, signed intent, diag.nvml result, watch query and type patterns, API tokens) for FUZZTIME each.
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh services/joinservice ./joinservice/ FuzzJoinRequest
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh services/joinservice ./joinservice/ FuzzRenewNodeCertificate
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh services/gateway ./gateway/ FuzzSessionMessage
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh pkg ./sessionwire/ FuzzReadMessage
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh services/controllers ./controllers/ FuzzAcceptanceResult
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh services/api ./api/ FuzzWatchQuery
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh pkg ./iam/ FuzzParseBearer
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh pkg ./pki/ FuzzParseCSR
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh pkg ./pki/ FuzzPins
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh pkg ./pki/ FuzzGatewayURLs
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh pkg ./pki/ FuzzWellKnown
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh pkg ./agent/ FuzzJoinResponse
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh pkg ./daemon/ FuzzVerifyIntent
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh pkg ./store/ FuzzEventFilter

# The fleet simulator: SEEDS seeds × the chaos levels none, light and heavy
# (the levels in parallel), one line per run and a summary.
SEEDS ?= 20
.PHONY: sim-matrix
sim-matrix: ## Run the fleet simulator for SEEDS (20) seeds × chaos none, light, heavy at 200 nodes for 10 simulated minutes; fail on any violation.
	SEEDS=$(SEEDS) NODES=200 DURATION=10m GO=$(GO) scripts/sim-matrix.sh

.PHONY: test
test: images ## Run every test suite (unit, integration, fuzz for FUZZTIME, compose end to end).
	$(MAKE) --no-print-directory test-unit
	$(MAKE) --no-print-directory fuzz
	$(MAKE) --no-print-directory test-e2e

.PHONY: check
check: vet lint generate-check breaking test ## vet, lint, generate-and-diff, buf breaking, and every test.

# tests/bench (docs/benchmarks.md): issue 19's table (commands, reservations,
# join → adoption, the idle fleet; every service and the machines in
# processes of their own from bin/linux, which images builds), then tunnels,
# the events watch, a retention pass over 10 million events while commands
# run (about 10 minutes of the run) and `better-compute dev`.
# How many times `make bench` runs each benchmark of issue 19's table (its
# figures are printed as min/median/max over the runs).
BENCH_RUNS ?= 3
# The benchmarks of that table (every service a process of its own) and the
# others, run once.
BENCH_TABLE := ^Benchmark(Commands|Reservations|JoinToAdoption|IdleFleet)$$
BENCH_OTHERS := ^Benchmark(Tunnels|EventsWatch|Retention|Dev)$$

.PHONY: bench
bench: images ## Run the benchmarks (BETTER_COMPUTE_BENCH_MACHINES=1000): the table's BENCH_RUNS (3) times each, printed as min/median/max with the machine, then the others once, the fleet simulator's speed too.
	cd tests && $(GO) test -run '^$$' -bench '$(BENCH_TABLE)' -benchtime 1x -count $(BENCH_RUNS) -timeout 90m ./bench/
	cd tests && $(GO) test -run '^$$' -bench '$(BENCH_OTHERS)' -benchtime 1x -timeout 75m ./bench/
	cd services/gateway && $(GO) test -run '^$$' -bench IdleSessionMemory -benchtime 1x -timeout 10m ./gateway/
	cd services/controllers && $(GO) test -run '^$$' -bench Acceptance1000 -benchtime 3x -timeout 10m ./controllers/
	cd pkg && $(GO) test -run '^$$' -bench '^BenchmarkSim$$' -benchtime 1x -timeout 10m ./sim/

.PHONY: clean
clean: ## Remove built binaries and tools.
	rm -rf bin
