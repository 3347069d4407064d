# Prometheus image of compose's observability profile, built by
# scripts/images.sh (`scripts/images.sh observability`) from a static
# prometheus that `go build` made on the host from its Go module (no registry
# pull: FROM scratch; no web UI assets, the HTTP API is all there is).
# Build context (made by the script): prometheus, promtool, bc-healthcheck
# (the compose health check: scratch has no shell), rootfs/ (tmp/ 1777),
# data/. The configuration (prometheus.yml, rules.yml) is mounted at
# /etc/prometheus by compose.yaml.
FROM scratch
COPY rootfs/ /
COPY --chown=65534:65534 data/ /prometheus/
COPY prometheus /prometheus-server
COPY promtool /promtool
COPY bc-healthcheck /bc-healthcheck
USER 65534:65534
EXPOSE 9090
ENTRYPOINT ["/prometheus-server"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", "--web.listen-address=:9090"]
