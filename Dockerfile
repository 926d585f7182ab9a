# One image for both services (block manager and compute node); the compose file picks the
# command. It installs with the README's own set-up path (scripts/run.sh setup): a venv,
# torch==2.13.0 first, then the project (CPU image: no extras; GPU image: the [cuda] extra).
#   CPU image (default):  docker build -t pagedkv .
#   GPU image:            docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                           --build-arg PAGEDKV_EXTRAS=cuda -t pagedkv:gpu .
FROM python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PAGEDKV_EXTRAS=
ENV PIP_EXTRA_INDEX_URL=${TORCH_INDEX_URL} \
    PAGEDKV_EXTRAS=${PAGEDKV_EXTRAS} \
    PAGEDKV_VENV=/opt/venv \
    PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY scripts ./scripts
COPY block_manager ./block_manager
COPY compute_node ./compute_node
COPY demo ./demo
COPY engine ./engine
COPY kernels ./kernels
COPY pagedkv ./pagedkv
COPY proto ./proto
RUN ./scripts/run.sh setup
ENV PATH=/opt/venv/bin:$PATH
