# Multi-stage build of both binaries; pick one with --target:
#   docker build --target sidecar  -t ferry-sidecar:dev .
#   docker build --target operator -t ferry-operator:dev .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p ferry-sidecar -p ferry-operator

FROM gcr.io/distroless/cc-debian12:nonroot AS sidecar
COPY --from=build /src/target/release/ferry-sidecar /usr/local/bin/ferry-sidecar
USER nonroot
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/ferry-sidecar"]

FROM gcr.io/distroless/cc-debian12:nonroot AS operator
COPY --from=build /src/target/release/ferry-operator /usr/local/bin/ferry-operator
USER nonroot
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/ferry-operator"]
CMD ["run"]
