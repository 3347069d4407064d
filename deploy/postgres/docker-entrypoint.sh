#!/bin/sh
# Entrypoint for better-compute/postgres, an image built from Debian packages
# (see scripts/images.sh). It mimics the official postgres image's interface so
# the same compose file and testcontainers' postgres module work with either:
#
#   POSTGRES_USER              superuser name (default: postgres)
#   POSTGRES_PASSWORD          its password (required unless POSTGRES_HOST_AUTH_METHOD=trust)
#   POSTGRES_DB                database created on first start (default: $POSTGRES_USER)
#   POSTGRES_INITDB_ARGS       extra arguments for initdb
#   POSTGRES_HOST_AUTH_METHOD  auth method of the "host all all all" line (default: scram-sha-256)
#   PGDATA                     data directory (default: /var/lib/postgresql/data)
#   /docker-entrypoint-initdb.d/*.sh, *.sql, *.sql.gz   run once, on first start
#
# On first start it runs initdb, a temporary server (unix socket only) for the
# init scripts, stops it, then execs the real server in the foreground, so the
# line "database system is ready to accept connections" appears twice.
set -eu

: "${PGDATA:=/var/lib/postgresql/data}"
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
: "${POSTGRES_PASSWORD:=}"
: "${POSTGRES_INITDB_ARGS:=}"
: "${POSTGRES_HOST_AUTH_METHOD:=scram-sha-256}"
export PGDATA POSTGRES_USER POSTGRES_DB

log() { printf '%s\n' "docker-entrypoint: $*"; }
die() { printf '%s\n' "docker-entrypoint: error: $*" >&2; exit 1; }

# "docker run IMAGE -c foo=bar" means "postgres -c foo=bar".
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
	set -- postgres "$@"
fi

# Anything but the server itself (psql, pg_isready, sh, ...), and the server's
# informational modes (postgres --version, --help, ...), run as asked.
if [ "$1" != postgres ]; then
	exec "$@"
fi
for arg; do
	case "$arg" in
	-'?' | --help | --describe-config | -V | --version) exec "$@" ;;
	esac
done

# As root: prepare the directories, then re-run this script as postgres.
if [ "$(id -u)" = 0 ]; then
	mkdir -p "$PGDATA" /var/run/postgresql
	chmod 00700 "$PGDATA" || :
	chown postgres:postgres "$PGDATA" || :
	# Only the top of a fresh data dir is chowned; an existing one keeps its owner.
	if [ ! -s "$PGDATA/PG_VERSION" ]; then
		chown -R postgres:postgres "$PGDATA"
	fi
	chown postgres:postgres /var/run/postgresql
	chmod 03775 /var/run/postgresql
	exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

psql_init() {
	psql -v ON_ERROR_STOP=1 --no-password --no-psqlrc --username "$POSTGRES_USER" "$@"
}

if [ ! -s "$PGDATA/PG_VERSION" ]; then
	if [ -z "$POSTGRES_PASSWORD" ] && [ "$POSTGRES_HOST_AUTH_METHOD" != trust ]; then
		die "database is uninitialized and POSTGRES_PASSWORD is not set;" \
			"set it to a non-empty value, or POSTGRES_HOST_AUTH_METHOD=trust to allow" \
			"all connections without a password (not recommended)"
	fi

	log "initializing database in $PGDATA"
	pwfile=
	if [ -n "$POSTGRES_PASSWORD" ]; then
		pwfile=$(mktemp)
		printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
	fi
	# shellcheck disable=SC2086 # POSTGRES_INITDB_ARGS is a word list on purpose
	initdb --username="$POSTGRES_USER" ${pwfile:+--pwfile="$pwfile"} \
		--locale=C.UTF-8 --encoding=UTF8 \
		--auth-local=trust --auth-host="$POSTGRES_HOST_AUTH_METHOD" \
		$POSTGRES_INITDB_ARGS
	[ -z "$pwfile" ] || rm -f "$pwfile"

	{
		printf '\n'
		printf '%s\n' "# added by docker-entrypoint.sh"
		printf '%s\n' "listen_addresses = '*'"
		# The control plane's load is many small write transactions
		# (commands, events, outbox, last_seen): a working set that fits in
		# the buffers, compressed full-page images and checkpoints far
		# enough apart that few pages are written whole. Durability is
		# unchanged (fsync and synchronous_commit stay on).
		printf '%s\n' "shared_buffers = 256MB"
		printf '%s\n' "wal_compression = on"
		printf '%s\n' "max_wal_size = 2GB"
		printf '%s\n' "checkpoint_timeout = 15min"
	} >>"$PGDATA/postgresql.conf"
	printf '\nhost all all all %s\n' "$POSTGRES_HOST_AUTH_METHOD" >>"$PGDATA/pg_hba.conf"

	# Temporary server: unix socket only, so nothing can connect over TCP
	# before the init scripts are done.
	pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start

	if [ "$POSTGRES_DB" != postgres ]; then
		log "creating database $POSTGRES_DB"
		psql_init --dbname postgres --set db="$POSTGRES_DB" <<-'EOSQL'
			CREATE DATABASE :"db" ;
		EOSQL
	fi

	for f in /docker-entrypoint-initdb.d/*; do
		[ -e "$f" ] || continue
		case "$f" in
		*.sh)
			if [ -x "$f" ]; then
				log "running $f"
				"$f"
			else
				log "sourcing $f"
				# shellcheck disable=SC1090
				. "$f"
			fi
			;;
		*.sql)
			log "running $f"
			psql_init --dbname "$POSTGRES_DB" -f "$f"
			;;
		*.sql.gz)
			log "running $f"
			gzip -dc "$f" | psql_init --dbname "$POSTGRES_DB"
			;;
		*) log "ignoring $f" ;;
		esac
	done

	pg_ctl -D "$PGDATA" -m fast -w stop
	log "PostgreSQL init process complete; ready for start up."
else
	log "PostgreSQL database directory appears to contain a database; skipping initialization"
fi

exec "$@"
