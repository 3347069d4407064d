#!/bin/sh
# Runs INSIDE the chroot of a fresh `debootstrap --variant=minbase bookworm`
# root file system (scripts/images.sh copies it in and runs it), and turns it
# into the root file system of better-compute/postgres.
# /etc/apt/sources.list has already been written by scripts/images.sh from the
# host's own apt configuration.
set -eux

PG_MAJOR=${PG_MAJOR:-15}
export DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 LC_ALL=C.UTF-8

# No service may start while packages are installed.
printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
chmod 0755 /usr/sbin/policy-rc.d

# Keep the image small: no docs, man pages or translations, no recommends.
cat >/etc/dpkg/dpkg.cfg.d/better-compute-excludes <<'EOF'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/lintian/*
path-exclude=/usr/share/locale/*
EOF
cat >/etc/apt/apt.conf.d/99better-compute <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
EOF

# Same ids as the official image, so data directories are interchangeable.
groupadd -r postgres --gid=999
useradd -r -g postgres --uid=999 --home-dir=/var/lib/postgresql --shell=/bin/bash postgres
mkdir -p /var/lib/postgresql
chown -R postgres:postgres /var/lib/postgresql

apt-get update
apt-get install -y postgresql-common
# No cluster from the package: the entrypoint runs initdb itself.
sed -ri 's/#(create_main_cluster) .*$/\1 = false/' /etc/postgresql-common/createcluster.conf
grep -q '^create_main_cluster = false' /etc/postgresql-common/createcluster.conf
# postgresql-15 ships the contrib extensions (btree_gist among them).
apt-get install -y "postgresql-$PG_MAJOR"
test -f "/usr/share/postgresql/$PG_MAJOR/extension/btree_gist.control"
test -x "/usr/lib/postgresql/$PG_MAJOR/bin/pg_isready"

mkdir -p /var/run/postgresql /docker-entrypoint-initdb.d
chown -R postgres:postgres /var/run/postgresql
chmod 03775 /var/run/postgresql

rm -f /usr/sbin/policy-rc.d
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/cache/debconf/*-old \
	/var/log/* /usr/share/man/* /usr/share/info/* /usr/share/locale/* \
	/tmp/* /var/tmp/*
# Docs of the packages debootstrap installed (before the excludes above),
# except the copyright files.
find /usr/share/doc ! -type d ! -name copyright -delete
find /usr/share/doc -depth -type d -empty -delete
