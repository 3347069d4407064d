#!/usr/bin/env bash
# Builds every container image better-compute needs, from local sources only
# (no image is pulled from any registry): Debian packages through the host's
# own apt mirror, Go modules through the Go module proxy, and the binaries the
# Makefile builds into bin/linux/.
#
# Each image carries the label org.better-compute.inputs-hash, a hash of what it
# is built from; an image whose label already matches is skipped, so a second
# run takes seconds. See usage() for the commands and variables.
set -euo pipefail

usage() {
	cat <<'EOF'
usage: scripts/images.sh [--force] [all|postgres|nats|services [NAME...]|observability]...

  all       postgres, nats and services (the default)
  postgres  ${BETTER_COMPUTE_POSTGRES_IMAGE:-better-compute/postgres:15}:
            debootstrap'd Debian bookworm + postgresql-15, official-image-like
            entrypoint
  nats      ${BETTER_COMPUTE_NATS_IMAGE:-better-compute/nats:<version>}: static
            nats-server built with `go install`, on scratch
  services  ${BETTER_COMPUTE_IMAGE_PREFIX:-better-compute}/<name>:${BETTER_COMPUTE_IMAGE_TAG:-dev}
            for each static binary $BIN_DIR/<name> (default bin/linux/, built by
            the Makefile); names: $BETTER_COMPUTE_SERVICES (default: api
            joinservice gateway scheduler controllers fakedaemon
            better-compute), or the NAMEs given. With a tag other than dev
            (`make images` passes `git describe --tags --always --dirty`),
            each image is also tagged dev, the tag compose.yaml and the
            tests use by default
  observability
            ${BETTER_COMPUTE_PROMETHEUS_IMAGE:-better-compute/prometheus:<version>}
            and ${BETTER_COMPUTE_JAEGER_IMAGE:-better-compute/jaeger:<version>}
            for compose's observability profile (`make up OBS=1`): static
            prometheus + promtool and jaeger built with `go build` from their
            Go modules, on scratch. Not part of all: the first build takes
            many minutes
  --force   rebuild even when an up-to-date image exists (also re-runs
            debootstrap and go install)

environment:
  BETTER_COMPUTE_POSTGRES_IMAGE  postgres image name   (better-compute/postgres:15)
  BETTER_COMPUTE_NATS_VERSION    nats-server version   (v2.15.2)
  BETTER_COMPUTE_NATS_IMAGE      nats image name       (better-compute/nats:<version without v>)
  BETTER_COMPUTE_PROMETHEUS_VERSION  prometheus version (v0.316.0)
  BETTER_COMPUTE_PROMETHEUS_IMAGE    its image name     (better-compute/prometheus:<version without v>)
  BETTER_COMPUTE_JAEGER_VERSION  jaeger version        (v1.75.0)
  BETTER_COMPUTE_JAEGER_IMAGE    its image name        (better-compute/jaeger:<version without v>)
  BETTER_COMPUTE_IMAGE_PREFIX    service image prefix  (better-compute)
  BETTER_COMPUTE_IMAGE_TAG       service image tag     (dev; compose.yaml reads it too;
                                 another is a version, and dev its alias)
  BETTER_COMPUTE_SERVICES        service names         (see above)
  BIN_DIR                        where the service binaries are (<repo>/bin/linux)
  BETTER_COMPUTE_CACHE_DIR       cache (rootfs, nats-server, logs)
                                 (${XDG_CACHE_HOME:-$HOME/.cache}/better-compute)
  BETTER_COMPUTE_DEBIAN_MIRROR   Debian mirror for debootstrap (default: read from /etc/apt)
  BETTER_COMPUTE_DEBIAN_SECURITY_MIRROR
                                 mirror of bookworm-security (default: read from /etc/apt)
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEPLOY=$ROOT/deploy
CACHE_DIR=${BETTER_COMPUTE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/better-compute}
LABEL=org.better-compute.inputs-hash
# Bump to invalidate every image built by an older version of this script.
SCHEMA=1

PG_MAJOR=15
PG_SUITE=bookworm
PG_PACKAGES="postgresql-$PG_MAJOR"
PG_IMAGE=${BETTER_COMPUTE_POSTGRES_IMAGE:-better-compute/postgres:$PG_MAJOR}

NATS_VERSION=${BETTER_COMPUTE_NATS_VERSION:-v2.15.2}
NATS_IMAGE=${BETTER_COMPUTE_NATS_IMAGE:-better-compute/nats:${NATS_VERSION#v}}

PROM_VERSION=${BETTER_COMPUTE_PROMETHEUS_VERSION:-v0.316.0}
PROM_IMAGE=${BETTER_COMPUTE_PROMETHEUS_IMAGE:-better-compute/prometheus:${PROM_VERSION#v}}
JAEGER_VERSION=${BETTER_COMPUTE_JAEGER_VERSION:-v1.75.0}
JAEGER_IMAGE=${BETTER_COMPUTE_JAEGER_IMAGE:-better-compute/jaeger:${JAEGER_VERSION#v}}

IMAGE_PREFIX=${BETTER_COMPUTE_IMAGE_PREFIX:-better-compute}
SERVICE_TAG=${BETTER_COMPUTE_IMAGE_TAG:-dev}
# The tag compose.yaml and the tests use by default, given to every service
# image whatever its version tag.
ALIAS_TAG=dev
BIN_DIR=${BIN_DIR:-$ROOT/bin/linux}
DEFAULT_SERVICES="api joinservice gateway scheduler controllers fakedaemon better-compute"
read -r -a SERVICES <<<"${BETTER_COMPUTE_SERVICES:-$DEFAULT_SERVICES}"

export DOCKER_BUILDKIT=0 # no buildx here: the classic builder

FORCE=0
STARTED=$SECONDS

# Paths removed on exit, whatever happens (temporary build contexts, a
# half-made root file system).
CLEANUP=()
cleanup() {
	local p
	for p in ${CLEANUP[@]+"${CLEANUP[@]}"}; do
		rm -rf --one-file-system "$p"
	done
}
trap cleanup EXIT

log() { printf '==> %s\n' "$*" >&2; }
die() {
	printf 'images.sh: error: %s\n' "$*" >&2
	exit 1
}

# hash_of: sha256 of stdin.
hash_of() { sha256sum | cut -d' ' -f1; }

# image_label IMAGE: the inputs-hash label of IMAGE, empty when there is none.
image_label() {
	docker image inspect --format "{{index .Config.Labels \"$LABEL\"}}" "$1" 2>/dev/null || true
}

# up_to_date IMAGE HASH: true when IMAGE exists with HASH (and no --force).
up_to_date() {
	[[ $FORCE == 0 && "$(image_label "$1")" == "$2" ]]
}

# drop_old OLD_ID: remove an image that a rebuild has left without a tag.
drop_old() {
	local old=$1
	[[ -n $old ]] || return 0
	if [[ -z "$(docker image inspect --format '{{join .RepoTags " "}}' "$old" 2>/dev/null)" ]]; then
		docker image rm "$old" >/dev/null 2>&1 || true
	fi
}

image_id() { docker image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

# run_logged LOG CMD...: run CMD with its output in LOG; show the end of it on failure.
run_logged() {
	local logfile=$1
	shift
	if ! "$@" >"$logfile" 2>&1; then
		tail -n 40 "$logfile" >&2
		die "failed: $* (full log: $logfile)"
	fi
}

# docker_build LOG ARGS...: `docker build ARGS` (classic builder, stdin passed
# on), quiet unless it fails.
docker_build() {
	local logfile=$1
	shift
	if ! docker build "$@" >"$logfile" 2>&1; then
		tail -n 40 "$logfile" >&2
		die "docker build failed (full log: $logfile)"
	fi
}

# apt_uri SUITE: the first enabled "deb" source of the host (/etc/apt) that
# serves SUITE with component main, in one-line or deb822 format.
apt_uri() {
	local suite=$1 f
	local files=()
	[[ -f /etc/apt/sources.list ]] && files+=(/etc/apt/sources.list)
	for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
		[[ -f $f ]] && files+=("$f")
	done
	((${#files[@]})) || return 0
	for f in "${files[@]}"; do
		if [[ $f == *.sources ]]; then
			awk -v suite="$suite" '
				BEGIN { RS = ""; FS = "\n" }
				{
					types = uris = suites = comps = ""; enabled = "yes"
					for (i = 1; i <= NF; i++) {
						line = $i
						if (line ~ /^[ \t]*#/) continue
						key = tolower(line); sub(/:.*/, "", key)
						val = line; sub(/^[^:]*:[ \t]*/, "", val)
						if (key == "types") types = val
						else if (key == "uris") uris = val
						else if (key == "suites") suites = val
						else if (key == "components") comps = val
						else if (key == "enabled") enabled = tolower(val)
					}
					if (enabled == "no" || enabled == "false") next
					if ((" " types " ") !~ / deb /) next
					if ((" " suites " ") !~ (" " suite " ")) next
					if ((" " comps " ") !~ / main /) next
					split(uris, u, /[ \t]+/); print u[1]; exit
				}' "$f"
		else
			awk -v suite="$suite" '
				$1 == "deb" {
					i = 2
					if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
					uri = $(i); s = $(i + 1); comps = ""
					for (j = i + 2; j <= NF; j++) comps = comps " " $j
					if (s == suite && (comps " ") ~ / main /) { print uri; exit }
				}' "$f"
		fi
	done | head -n 1
}

lock_cache() {
	mkdir -p "$CACHE_DIR"
	exec 9>"$CACHE_DIR/.lock"
	if ! flock -n 9; then
		log "waiting for another images.sh run (lock $CACHE_DIR/.lock)"
		flock 9
	fi
}

# ---------------------------------------------------------------- postgres --

build_postgres() {
	local t0=$SECONDS
	local ctx=$DEPLOY/postgres
	local rootfs_hash hash
	rootfs_hash=$( {
		echo "schema=$SCHEMA suite=$PG_SUITE variant=minbase packages=$PG_PACKAGES major=$PG_MAJOR"
		cat "$ctx/setup-rootfs.sh"
	} | hash_of)
	hash=$( {
		echo "rootfs=$rootfs_hash"
		cat "$ctx/Dockerfile" "$ctx/docker-entrypoint.sh"
	} | hash_of)

	if up_to_date "$PG_IMAGE" "$hash"; then
		log "skip  $PG_IMAGE (up to date, ${hash:0:12})"
		return
	fi
	log "build $PG_IMAGE (${hash:0:12})"

	local dir=$CACHE_DIR/postgres
	local rootfs=$dir/rootfs-${rootfs_hash:0:16}
	mkdir -p "$dir"
	if [[ $FORCE == 1 || ! -f $rootfs/.complete ]]; then
		make_rootfs "$rootfs"
	else
		log "      reusing root file system $rootfs"
	fi

	local old base
	old=$(image_id "$PG_IMAGE")
	log "      docker import + docker build"
	# The imported base stays untagged: it is only the parent of the image.
	base=$(tar --numeric-owner --exclude=./.complete -C "$rootfs" -c . |
		docker import --message "Debian $PG_SUITE minbase + $PG_PACKAGES" -)
	docker_build "$dir/docker-build.log" -f "$ctx/Dockerfile" --build-arg "BASE=$base" \
		--label "$LABEL=$hash" -t "$PG_IMAGE" "$ctx"
	drop_old "$old"
	log "      built $PG_IMAGE in $((SECONDS - t0))s"
}

# make_rootfs DIR: debootstrap + setup-rootfs.sh into DIR (atomically).
make_rootfs() {
	local rootfs=$1 dir
	dir=$(dirname "$rootfs")
	command -v debootstrap >/dev/null || {
		log "      installing debootstrap (apt-get)"
		run_logged "$dir/apt-get.log" sh -c \
			'apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap'
	}
	local mirror security
	mirror=${BETTER_COMPUTE_DEBIAN_MIRROR:-$(apt_uri "$PG_SUITE")}
	security=${BETTER_COMPUTE_DEBIAN_SECURITY_MIRROR:-$(apt_uri "$PG_SUITE-security")}
	[[ -n $mirror ]] || die "no apt source for '$PG_SUITE main' in /etc/apt; set BETTER_COMPUTE_DEBIAN_MIRROR"

	local tmp=$dir/rootfs.tmp
	rm -rf --one-file-system "$tmp"
	CLEANUP+=("$tmp") # moved into place below when complete

	log "      debootstrap --variant=minbase $PG_SUITE (log: $dir/debootstrap.log)"
	run_logged "$dir/debootstrap.log" \
		debootstrap --variant=minbase "$PG_SUITE" "$tmp" "$mirror"

	{
		echo "deb $mirror $PG_SUITE main"
		echo "deb $mirror $PG_SUITE-updates main"
		[[ -z $security ]] || echo "deb $security $PG_SUITE-security main"
	} >"$tmp/etc/apt/sources.list"
	install -m 0755 "$DEPLOY/postgres/setup-rootfs.sh" "$tmp/tmp/setup-rootfs.sh"

	log "      installing $PG_PACKAGES in the chroot (log: $dir/setup-rootfs.log)"
	run_logged "$dir/setup-rootfs.log" \
		chroot "$tmp" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
		PG_MAJOR="$PG_MAJOR" /bin/sh /tmp/setup-rootfs.sh
	# The host's; Docker provides its own at run time.
	: >"$tmp/etc/resolv.conf"
	echo localhost >"$tmp/etc/hostname"

	touch "$tmp/.complete"
	local old
	for old in "$dir"/rootfs-*; do
		[[ -d $old ]] && rm -rf --one-file-system "$old"
	done
	mv "$tmp" "$rootfs"
}

# -------------------------------------------------------------------- nats --

build_nats() {
	local t0=$SECONDS
	local dockerfile=$DEPLOY/nats/Dockerfile
	# bc-healthcheck: the compose health check of a scratch image (no shell).
	local hc
	hc=$(mktemp -d)
	CLEANUP+=("$hc")
	CGO_ENABLED=0 go build -C "$ROOT/pkg" -trimpath -ldflags='-s -w' -o "$hc/bc-healthcheck" ./service/healthcheck
	local hash
	hash=$( {
		echo "schema=$SCHEMA nats=$NATS_VERSION"
		cat "$dockerfile"
		sha256sum <"$hc/bc-healthcheck"
	} | hash_of)
	if up_to_date "$NATS_IMAGE" "$hash"; then
		log "skip  $NATS_IMAGE (up to date, ${hash:0:12})"
		return
	fi
	log "build $NATS_IMAGE (${hash:0:12})"

	local dir=$CACHE_DIR/nats/$NATS_VERSION
	local bin=$dir/nats-server
	if [[ $FORCE == 1 || ! -x $bin ]]; then
		mkdir -p "$dir"
		local gobin
		gobin=$(mktemp -d "$dir/gobin.XXXXXX")
		CLEANUP+=("$gobin")
		log "      go install github.com/nats-io/nats-server/v2@$NATS_VERSION (log: $dir/go-install.log)"
		# Outside the repo, so its go.mod/go.work play no part.
		run_logged "$dir/go-install.log" \
			env -C "$gobin" CGO_ENABLED=0 GOWORK=off GOFLAGS=-trimpath GOBIN="$gobin" \
			go install -ldflags='-s -w' "github.com/nats-io/nats-server/v2@$NATS_VERSION"
		mv "$gobin/nats-server" "$bin"
		rm -rf "$gobin"
	else
		log "      reusing $bin"
	fi

	local ctx
	ctx=$(mktemp -d)
	CLEANUP+=("$ctx")
	mkdir -p "$ctx/rootfs/tmp" "$ctx/data"
	chmod 1777 "$ctx/rootfs/tmp"
	cp "$bin" "$ctx/nats-server"
	cp "$hc/bc-healthcheck" "$ctx/bc-healthcheck"
	local old
	old=$(image_id "$NATS_IMAGE")
	docker_build "$CACHE_DIR/nats/docker-build.log" -f "$dockerfile" --label "$LABEL=$hash" -t "$NATS_IMAGE" "$ctx"
	drop_old "$old"
	log "      built $NATS_IMAGE in $((SECONDS - t0))s"
}

# ----------------------------------------------------------- observability --

# healthcheck_bin DIR: bc-healthcheck (the compose health check of a scratch
# image, which has no shell) built into DIR.
healthcheck_bin() {
	CGO_ENABLED=0 go build -C "$ROOT/pkg" -trimpath -ldflags='-s -w' -o "$1/bc-healthcheck" ./service/healthcheck
}

# go_module_build MODULE VERSION OUT PKG...: static binaries of the packages
# PKG of MODULE@VERSION into the directory OUT (one per package, named after
# its last path element). A throwaway main module whose go.mod is MODULE's
# own (its requirements and replace directives, which `go install pkg@version`
# refuses) plus a requirement of MODULE builds them, so the versions are the
# ones MODULE was released with. Outside the repo, so its go.mod/go.work play
# no part.
go_module_build() {
	local module=$1 version=$2 out=$3
	shift 3
	local dir=$out/build
	rm -rf "$dir"
	mkdir -p "$dir"
	CLEANUP+=("$dir")
	local modfile
	modfile=$(env -C "$dir" GOWORK=off GOFLAGS=-mod=mod go mod download -json "$module@$version" |
		sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
	[[ -f $modfile ]] || die "no go.mod of $module@$version in the module cache"
	{
		sed -e 's#^module .*#module better-compute.local/build#' "$modfile"
		echo "require $module $version"
	} >"$dir/go.mod"
	local pkg
	for pkg in "$@"; do
		run_logged "$out/go-build.log" \
			env -C "$dir" CGO_ENABLED=0 GOWORK=off GOFLAGS="-trimpath -mod=mod" \
			go build -ldflags='-s -w' -o "$dir/$(basename "$pkg")" "$pkg"
	done
	for pkg in "$@"; do
		mv "$dir/$(basename "$pkg")" "$out/"
	done
	rm -rf "$dir"
}

# build_gomod_image IMAGE DOCKERFILE MODULE VERSION PKG...: the image
# IMAGE of DOCKERFILE with the binaries of PKG (go_module_build, kept in
# the cache) and bc-healthcheck in its context; skipped when its
# inputs-hash label is up to date.
build_gomod_image() {
	local image=$1 dockerfile=$2 module=$3 version=$4 t0=$SECONDS
	shift 4
	local hc
	hc=$(mktemp -d)
	CLEANUP+=("$hc")
	healthcheck_bin "$hc"
	local hash
	hash=$( {
		echo "schema=$SCHEMA module=$module version=$version packages=$*"
		cat "$dockerfile"
		sha256sum <"$hc/bc-healthcheck"
	} | hash_of)
	if up_to_date "$image" "$hash"; then
		log "skip  $image (up to date, ${hash:0:12})"
		return
	fi
	log "build $image (${hash:0:12})"
	local dir=$CACHE_DIR/${module##*/}/$version pkg missing=0
	mkdir -p "$dir"
	for pkg in "$@"; do
		[[ -x $dir/$(basename "$pkg") ]] || missing=1
	done
	if [[ $FORCE == 1 || $missing == 1 ]]; then
		log "      go build $* from $module@$version (log: $dir/go-build.log)"
		go_module_build "$module" "$version" "$dir" "$@"
	else
		log "      reusing the binaries in $dir"
	fi
	local ctx
	ctx=$(mktemp -d)
	CLEANUP+=("$ctx")
	mkdir -p "$ctx/rootfs/tmp" "$ctx/data"
	chmod 1777 "$ctx/rootfs/tmp"
	for pkg in "$@"; do
		cp "$dir/$(basename "$pkg")" "$ctx/"
	done
	cp "$hc/bc-healthcheck" "$ctx/bc-healthcheck"
	local old
	old=$(image_id "$image")
	docker_build "$dir/docker-build.log" -f "$dockerfile" --label "$LABEL=$hash" -t "$image" "$ctx"
	drop_old "$old"
	log "      built $image in $((SECONDS - t0))s"
}

build_observability() {
	build_gomod_image "$PROM_IMAGE" "$DEPLOY/observability/prometheus.Dockerfile" \
		github.com/prometheus/prometheus "$PROM_VERSION" \
		github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool
	build_gomod_image "$JAEGER_IMAGE" "$DEPLOY/observability/jaeger.Dockerfile" \
		github.com/jaegertracing/jaeger "$JAEGER_VERSION" \
		github.com/jaegertracing/jaeger/cmd/jaeger
}

# ---------------------------------------------------------------- services --

build_services() {
	local names=("$@")
	((${#names[@]})) || names=("${SERVICES[@]}")
	local name missing=()
	for name in "${names[@]}"; do
		[[ -f $BIN_DIR/$name ]] || missing+=("$name")
	done
	((${#missing[@]} == 0)) ||
		die "no binary for: ${missing[*]} in $BIN_DIR (run the Makefile's linux build, or set BIN_DIR)"
	for name in "${names[@]}"; do
		build_service "$name"
	done
}

build_service() {
	local name=$1 t0=$SECONDS
	local bin=$BIN_DIR/$name
	local image=$IMAGE_PREFIX/$name:$SERVICE_TAG
	local dockerfile=$DEPLOY/service.Dockerfile
	if command -v go >/dev/null && go version -m "$bin" 2>/dev/null | grep -q 'CGO_ENABLED=1'; then
		die "$bin was built with CGO_ENABLED=1; scratch images need a static binary (CGO_ENABLED=0)"
	fi
	local hash
	hash=$( {
		echo "schema=$SCHEMA name=$name"
		sha256sum <"$bin"
		cat "$dockerfile"
	} | hash_of)
	local alias=$IMAGE_PREFIX/$name:$ALIAS_TAG
	if up_to_date "$image" "$hash"; then
		log "skip  $image (up to date, ${hash:0:12})"
		tag_alias "$image" "$alias"
		return
	fi
	# Another version tag of the same inputs (a new commit that changed
	# nothing of this image) is the same image under a new name.
	if [[ $alias != "$image" ]] && up_to_date "$alias" "$hash"; then
		log "tag   $image (same inputs as $alias, ${hash:0:12})"
		docker tag "$alias" "$image"
		return
	fi
	log "build $image (${hash:0:12})"
	local ctx
	ctx=$(mktemp -d)
	CLEANUP+=("$ctx")
	mkdir -p "$ctx/rootfs/tmp" "$ctx/data" "$CACHE_DIR/services"
	chmod 1777 "$ctx/rootfs/tmp"
	cp "$bin" "$ctx/$name"
	chmod 0755 "$ctx/$name"
	local old
	old=$(image_id "$image")
	{
		cat "$dockerfile"
		printf 'ENTRYPOINT ["/%s"]\n' "$name"
	} | docker_build "$CACHE_DIR/services/$name.docker-build.log" -f - --build-arg "BIN=$name" \
		--label "$LABEL=$hash" -t "$image" "$ctx"
	drop_old "$old"
	tag_alias "$image" "$alias"
	log "      built $image in $((SECONDS - t0))s"
}

# tag_alias IMAGE ALIAS: tag IMAGE as ALIAS too (nothing when they are the
# same name), dropping the image ALIAS named before if nothing else names it.
tag_alias() {
	local image=$1 alias=$2 old
	[[ $alias != "$image" ]] || return 0
	old=$(image_id "$alias")
	[[ $old != "$(image_id "$image")" ]] || return 0
	docker tag "$image" "$alias"
	drop_old "$old"
}

# -------------------------------------------------------------------- main --

main() {
	local targets=() names=() arg
	for arg in "$@"; do
		case $arg in
		-h | --help)
			usage
			return 0
			;;
		-f | --force) FORCE=1 ;;
		all | postgres | nats | services | observability) targets+=("$arg") ;;
		-*) die "unknown option $arg (see --help)" ;;
		*)
			# NAMEs after "services"
			[[ ${#targets[@]} -gt 0 && ${targets[-1]} == services ]] ||
				die "unknown command $arg (see --help)"
			names+=("$arg")
			;;
		esac
	done
	((${#targets[@]})) || targets=(all)

	command -v docker >/dev/null || die "docker not found"
	docker info >/dev/null 2>&1 || die "cannot reach the Docker daemon"
	lock_cache

	local t
	for t in "${targets[@]}"; do
		case $t in
		all)
			build_postgres
			build_nats
			build_services
			;;
		postgres) build_postgres ;;
		nats) build_nats ;;
		services) build_services ${names[@]+"${names[@]}"} ;;
		observability) build_observability ;;
		esac
	done
	log "done in $((SECONDS - STARTED))s"
}

main "$@"
