# loraplex on a GPU host: gateway + engine in one process (`loraplex serve`), CUDA build of torch.
# Used by docker-compose.yml (with PostgreSQL for usage); tests/test_docker.py checks what it can.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.9-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    LORAPLEX_DATA_DIR=/data

# Triton (--attention-backend triton, the LoRA kernels) compiles its launcher with a C compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/loraplex
COPY . .
# README.md's test install without the CPU torch pin (the base image brings its CUDA torch), plus
# the gpu extra: triton, for --attention-backend triton and the Triton LoRA kernels. The test
# extra stays so the suite can run on the GPU host (`docker compose run loraplex ...`).
RUN pip install -e ".[gpu,test]"

RUN useradd --create-home --uid 1000 loraplex \
    && mkdir -p /data /models \
    && chown loraplex:loraplex /data
USER loraplex
VOLUME ["/data"]

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]

ENTRYPOINT ["loraplex"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--device", "cuda", "--data-dir", "/data"]
