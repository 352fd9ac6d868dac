# The image the Helm chart runs: the one `shardplane` binary (operator,
# gateway, agent) on a small Debian base, as a non-root user.
#   docker build -t REGISTRY/shardplane:0.1.0 .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p shardplane \
 && cp target/release/shardplane /shardplane

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /shardplane /usr/local/bin/shardplane
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/shardplane"]
