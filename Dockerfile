# lorafleet image: web (gunicorn), one-shot migrate and the GPU worker all run from it (docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LORAFLEET_VAR_DIR=/app/var

# Triton compiles a small C launcher the first time a kernel runs on the GPU, so the image keeps gcc.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app

# Dependencies first, exactly as pinned (==) in pyproject.toml, so a code change does not reinstall torch.
# torch's Linux wheel from PyPI brings its own CUDA runtime; the host needs only the NVIDIA driver and
# the container toolkit.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY . .

# Static files are collected at build time (whitenoise serves them); var/ must be writable by the app user.
RUN useradd --create-home --uid 1000 lorafleet \
    && DJANGO_SECRET_KEY=collectstatic-only python manage.py collectstatic --noinput \
    && chown -R lorafleet:lorafleet /app/var

USER lorafleet
EXPOSE 8000
# 128 threads: a tenant at the default concurrency cap (64) holds at most half (see docker-compose.yml's web)
CMD ["gunicorn", "config.wsgi:application", "--bind=0.0.0.0:8000", "--worker-class=gthread", "--threads=128"]
