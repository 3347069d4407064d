# Jaeger (v2, all in one, spans in memory) image of compose's observability
# profile, built by scripts/images.sh (`scripts/images.sh observability`)
# from a static jaeger that `go build` made on the host from its Go module
# (no registry pull: FROM scratch). It receives OTLP on 4317 (gRPC) and 4318
# (HTTP) and answers the query API (/api/services, /api/traces) on 16686.
# Build context (made by the script): jaeger, bc-healthcheck, rootfs/ (tmp/
# 1777).
FROM scratch
COPY rootfs/ /
COPY jaeger /jaeger
COPY bc-healthcheck /bc-healthcheck
USER 65534:65534
EXPOSE 4317 4318 16686
ENTRYPOINT ["/jaeger"]
