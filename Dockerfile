# syntax=docker/dockerfile:1.7
#
# One image for every nibble service: nibble, nibble-router, nibble-prefill, nibble-decode.
#
#   docker build -t nibble:dev .
#   docker run --rm nibble:dev nibble --help
#   docker run --rm --gpus all -v "$PWD/models:/models:ro" -p 8000:8000 -p 50051:50051 \
#       nibble:dev nibble up --model /models/SmolLM2-135M-Instruct.Q4_1.gguf
#
# Stage 1 builds the workspace in the official Rust image (protoc and the well-known-type protos
# of libprotobuf-dev, which protobuf-compiler only recommends, are needed by the build scripts of
# nibble-proto and etcd-client). Stage 2 runs on NVIDIA's CUDA *runtime* image, which carries
# the libraries the CUDA backend loads at run time through cudarc: NVRTC (cuda-libraries),
# cuBLAS/cuBLASLt and NCCL (libnccl2). No CUDA toolkit is needed to build: kernels are compiled
# by NVRTC when a worker starts. The GPU driver (libcuda) comes from the node through the NVIDIA
# container toolkit. The build fails if one of those libraries is missing from the base image.
#
# Build arguments (defaults are pinned; override them together with the workspace's cudarc
# CUDA-version feature):
#   RUST_IMAGE   the builder image
#   CUDA_IMAGE   the runtime image; CUDA_MAJOR its CUDA major version (12), e.g.
#                --build-arg CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04 --build-arg CUDA_MAJOR=13
#   CARGO_PROFILE  release (default)

ARG RUST_IMAGE=rust:1.95.0-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------
FROM ${RUST_IMAGE} AS build

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ARG CARGO_PROFILE=release

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        protobuf-compiler=3.21.* libprotobuf-dev=3.21.* \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY . .

# The cargo registry and target directory are BuildKit caches, so rebuilding after a source
# change recompiles only what changed. The binaries are copied out of the cache mount.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --locked --profile "${CARGO_PROFILE}" \
        -p nibble -p nibble-router -p nibble-prefill -p nibble-decode \
    && mkdir -p /out \
    && for bin in nibble nibble-router nibble-prefill nibble-decode; do \
        cp "target/${CARGO_PROFILE}/${bin}" "/out/${bin}"; \
    done

# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS runtime

# The CUDA major version of CUDA_IMAGE (the sonames the check below looks for).
ARG CUDA_MAJOR=12

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# tini is PID 1: it forwards signals to the service and reaps children. On SIGTERM (or SIGINT) a
# service leaves the etcd membership, stops accepting, gives open calls 5 s to finish, and exits.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        tini=0.19.* \
    && rm -rf /var/lib/apt/lists/*

# Fail the build, not the first GPU start, when the base image lacks a library the CUDA backend
# loads at run time (cudarc opens them with dlopen, so they must be on the loader's path).
RUN echo /usr/local/cuda/lib64 > /etc/ld.so.conf.d/zz-nibble-cuda.conf \
    && ldconfig \
    && ldconfig -p > /tmp/ld.cache \
    && missing=0 \
    && for lib in "libnvrtc.so.${CUDA_MAJOR}" "libcublas.so.${CUDA_MAJOR}" \
                  "libcublasLt.so.${CUDA_MAJOR}" libnccl.so.2; do \
        if ! grep -q "${lib}" /tmp/ld.cache; then echo "runtime image lacks ${lib}" >&2; missing=1; fi; \
    done \
    && rm /tmp/ld.cache \
    && exit "${missing}"

# A fixed, unprivileged uid/gid (Kubernetes' runAsNonRoot checks a numeric user).
RUN groupadd --system --gid 10001 nibble \
    && useradd --system --uid 10001 --gid nibble --home-dir /home/nibble --create-home \
        --shell /usr/sbin/nologin nibble \
    && mkdir -p /models \
    && chown nibble:nibble /models

COPY --from=build /out/ /usr/local/bin/

LABEL org.opencontainers.image.title="nibble" \
      org.opencontainers.image.description="nibble: disaggregated prefill/decode LLM serving with an NVFP4 KV cache (router, prefill and decode workers, CLI)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/nibble-serve/nibble"

# Every process reads its flags from NIBBLE_* variables too; these are the container defaults:
# every public port listens on all interfaces (the binaries' own default is loopback), so
# `docker run -p 8000:8000 IMAGE nibble up` serves the OpenAI API from outside the container.
ENV NIBBLE_LISTEN=0.0.0.0:50061 \
    NIBBLE_ROUTER_LISTEN=0.0.0.0:50051 \
    NIBBLE_HTTP_LISTEN=0.0.0.0:8000 \
    NIBBLE_METRICS_LISTEN=0.0.0.0:9090 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

USER 10001:10001
WORKDIR /home/nibble

# gRPC: router 50051, workers 50061; OpenAI HTTP on the router 8000; Prometheus metrics 9090.
EXPOSE 50051 50061 8000 9090

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["nibble", "--help"]
