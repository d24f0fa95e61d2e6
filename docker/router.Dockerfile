# syntax=docker/dockerfile:1
# UniCache router image: gRPC front door + OpenAI-compatible HTTP API.
#
# No torch and no ray: the router tokenizes, classifies, hashes and forwards. The
# dependencies come from docker/requirements-router.txt (a subset of pyproject.toml), then
# the package is installed with --no-deps so pip never pulls torch or ray.
#
# Build from the repository root:
#   docker build -f docker/router.Dockerfile -t unicache-router:0.1.0 .

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- builder: a self-contained virtualenv in /opt/venv ---------------------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY constraints.txt docker/requirements-router.txt ./
RUN pip install --no-cache-dir -c constraints.txt -r requirements-router.txt
COPY pyproject.toml README.md ./
COPY unicache unicache
COPY router router
COPY replica replica
RUN pip install --no-cache-dir --no-deps . \
    && python -c "import unicache.router.app, unicache.router.cli, unicache.cli.main" \
    && python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torch', 'ray')))"

# ---- runtime: the virtualenv on a clean base, as an unprivileged user -----------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="unicache-router" \
      org.opencontainers.image.description="UniCache Serving router: cache-aware gRPC and OpenAI-compatible HTTP front door" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 unicache \
    && useradd --system --uid 10001 --gid unicache --home-dir /home/unicache --create-home --shell /usr/sbin/nologin unicache
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    UNICACHE_GRPC_HOST=0.0.0.0 \
    UNICACHE_HTTP_HOST=0.0.0.0
USER 10001:10001
WORKDIR /home/unicache
EXPOSE 50051 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
ENTRYPOINT ["unicache"]
CMD ["router", "--grpc-port", "50051", "--http-port", "8000"]
