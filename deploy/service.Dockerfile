# Generic image for one better-compute service: a static (CGO_ENABLED=0) Go
# binary on scratch. Built by scripts/images.sh, which makes the context
# (the binary named BIN, plus rootfs/ and data/) and appends the line
#   ENTRYPOINT ["/<BIN>"]
# (an exec-form ENTRYPOINT cannot use a build arg). Building this file by other
# means (e.g. compose `build:`) needs `entrypoint: ["/<BIN>"]` next to it.
FROM scratch
ARG BIN
# /tmp (mode 1777), for os.TempDir users.
COPY rootfs/ /
# A writable data directory, e.g. /var/lib/fakedaemon for the fakedaemon.
COPY --chown=65534:65534 data/ /var/lib/${BIN}/
# The compose stack's named volumes mount here (pki: the deployment's keys,
# and in each control-plane service its own; export/<service>: where the
# pki-export one-shot writes each service's keys; shared: the join token and
# pins.json that machines read; secrets: the bootstrap's root credentials,
# mounted by nothing else). Docker copies a mount point's ownership into an
# empty named volume, so they start writable. The export directories are
# the services of pkg/pki Layout.
COPY --chown=65534:65534 data/ /var/lib/better-compute/pki/
COPY --chown=65534:65534 data/ /var/lib/better-compute/export/api/
COPY --chown=65534:65534 data/ /var/lib/better-compute/export/joinservice/
COPY --chown=65534:65534 data/ /var/lib/better-compute/export/gateway/
COPY --chown=65534:65534 data/ /var/lib/better-compute/export/scheduler/
COPY --chown=65534:65534 data/ /var/lib/better-compute/export/controllers/
COPY --chown=65534:65534 data/ /var/lib/better-compute/shared/
COPY --chown=65534:65534 data/ /var/lib/better-compute/secrets/
COPY ${BIN} /${BIN}
USER 65534:65534
