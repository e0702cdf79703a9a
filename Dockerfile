# Multi-stage build of both binaries; pick one with --target:
#   docker build --target sidecar      -t ferry-sidecar:dev .       (sim, remote; cuda on the CPU)
#   docker build --target sidecar-cuda -t ferry-sidecar:dev-cuda .  (the cuda engine on a GPU)
#   docker build --target operator     -t ferry-operator:dev .
# The sidecar is built with the CUDA code in both images: it loads the CUDA libraries at run time
# and, without them, runs the cuda engine on the CPU (with --device auto or cpu).
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p ferry-sidecar -p ferry-operator --features ferry-sidecar/cuda

FROM gcr.io/distroless/cc-debian12:nonroot AS sidecar
COPY --from=build /src/target/release/ferry-sidecar /usr/local/bin/ferry-sidecar
COPY --from=build /src/target/release/ferry-holder /usr/local/bin/ferry-holder
USER nonroot
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/ferry-sidecar"]

# cuBLAS and NVRTC come from NVIDIA's runtime image; the driver (libcuda.so) is mounted into the
# container by the NVIDIA container runtime on GPU nodes.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS sidecar-cuda
COPY --from=build /src/target/release/ferry-sidecar /usr/local/bin/ferry-sidecar
COPY --from=build /src/target/release/ferry-holder /usr/local/bin/ferry-holder
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/ferry-sidecar"]

FROM gcr.io/distroless/cc-debian12:nonroot AS operator
COPY --from=build /src/target/release/ferry-operator /usr/local/bin/ferry-operator
USER nonroot
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/ferry-operator"]
CMD ["run"]
