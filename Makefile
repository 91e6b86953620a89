GO      ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X main.version=$(VERSION)

.PHONY: all build run test vet lint fuzz deps deps-tools deps-minio bench bench-deps bench-pull bench-serve bench-cpu clean

all: build

## build: compile bin/pullproxy
build:
	$(GO) build -trimpath -ldflags "$(LDFLAGS)" -o bin/pullproxy ./cmd/pullproxy

## run: serve on 127.0.0.1:5000 with the built-in defaults, data in ./data
run: build
	./bin/pullproxy serve --listen 127.0.0.1:5000 --data-dir ./data

# The modules: pullproxy, and deploy/, whose tests read the deployment files
# with kustomize, Kubernetes' API types and Prometheus's PromQL parser, none
# of which pullproxy itself needs.
MODULES := . deploy

## test: vet, then every test with the race detector (deploy/'s, which only read files, without), then each fuzz test briefly
test: vet
	$(GO) test -race -count=1 -timeout 15m ./...
	cd deploy && $(GO) test -count=1 ./...
	$(MAKE) fuzz FUZZTIME=$(FUZZTIME)

vet:
	@set -e; for m in $(MODULES); do (cd $$m && $(GO) vet ./...); done

## lint: gofmt, staticcheck each module, and fail if `go mod tidy` would change its go.mod or go.sum
lint:
	@unformatted=$$(gofmt -l .); if [ -n "$$unformatted" ]; then echo "gofmt -l:"; echo "$$unformatted"; exit 1; fi
	@set -e; for m in $(MODULES); do \
		echo "lint: $$m"; \
		(cd $$m && staticcheck ./... && $(GO) mod tidy -diff); \
	done

## fuzz: each fuzz test for FUZZTIME, from its corpus under testdata/fuzz
# A count of executions, not a duration: with a duration, Go 1.26's fuzzing
# coordinator may fail a target with "context deadline exceeded" as the
# time runs out on a busy machine (golang/go#75804, fixed in Go 1.27).
FUZZTIME ?= 20000x
FUZZ := proxy:FuzzParseFastRequest proxy:FuzzResolve proxy:FuzzQueryValue proxy:FuzzParseByteRange \
	proxy:FuzzManifest upstream:FuzzParseChallenge storage:FuzzValidate
fuzz:
	@set -e; for t in $(FUZZ); do \
		echo "fuzz: ./$${t%%:*} $${t#*:} for $(FUZZTIME)"; \
		$(GO) test ./$${t%%:*} -run '^$$' -fuzz "^$${t#*:}\$$" -fuzztime $(FUZZTIME); \
	done

## bench: every benchmark, each writing its results under bench/ (root; make deps bench-deps first)
bench: bench-pull bench-serve bench-cpu

## bench-pull: the incident's 600 MiB image across the simulated carrier: the scenario matrix (quick: two seeds a path), and the other rows at RTT 0
bench-pull:
	$(GO) run ./bench/pullbench -runs 3 -rtts 0 -matrix quick -json bench/results.json

## bench-serve: cached blobs served by pullproxy, nginx and distribution, side by side
bench-serve:
	$(GO) run ./bench/servebench -runs 3 -json bench/serve-results.json

## bench-cpu: CPU time of a cold fetch, pullproxy against distribution's proxy mode: a mirror's first fetch
## after it starts, and one by a mirror process that has fetched another image (-warmup)
bench-cpu:
	$(GO) run ./bench/cpubench -runs 3 -json bench/cpu-results.json
	$(GO) run ./bench/cpubench -runs 3 -warmup -json bench/cpu-warm-results.json

## bench-deps: install what the benchmarks drive besides containerd (Debian; as root)
bench-deps:
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx wrk curl

## deps: install what the end-to-end tests drive (Debian and the Go module proxy; as root)
deps: deps-tools deps-minio

# The registry clients the tests pull, list and discover with (containerd's
# CRI plugin is driven by crictl, as the kubelet drives it; podman reads what
# node-config --crio writes), Debian's docker-registry (distribution 2.8, an
# upstream many sites still run), and the OCI distribution-spec conformance
# suite, at pinned versions, into TOOLBIN; and staticcheck, which lint runs.
TOOLBIN ?= /usr/local/bin
CONFORMANCE := github.com/opencontainers/distribution-spec/conformance@v0.0.0-20260831232431-97274622c111
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2
deps-tools:
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends containerd skopeo podman docker-registry iptables
	@# The tests start their own docker-registry; the package's service is not wanted.
	-systemctl disable --now docker-registry >/dev/null 2>&1
	GOBIN=$(TOOLBIN) $(GO) install github.com/google/go-containerregistry/cmd/crane@v0.22.1
	GOBIN=$(TOOLBIN) $(GO) install oras.land/oras/cmd/oras@v1.3.6
	GOBIN=$(TOOLBIN) $(GO) install github.com/regclient/regclient/cmd/regctl@v0.11.7
	GOBIN=$(TOOLBIN) $(GO) install sigs.k8s.io/cri-tools/cmd/crictl@v1.37.0
	tmp=$$(mktemp -d) && GOBIN=$$tmp $(GO) install $(CONFORMANCE) && mv $$tmp/conformance $(TOOLBIN)/oci-conformance && rmdir $$tmp
	GOBIN=$(TOOLBIN) $(GO) install $(STATICCHECK)

# MinIO, the S3-compatible server the replica tests share a bucket on. It
# takes minutes to build, so a binary already installed is kept.
MINIO := github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c
deps-minio:
	@if [ -x $(TOOLBIN)/minio ]; then echo "minio: keeping $(TOOLBIN)/minio"; \
	else echo "minio: building $(MINIO)"; GOBIN=$(TOOLBIN) $(GO) install -trimpath -ldflags "-s -w" $(MINIO); fi

clean:
	rm -rf bin
