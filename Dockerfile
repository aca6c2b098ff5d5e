# toolledger: one image for migrate, serve, api and the emulator (the command picks which).
FROM python:3.11-slim

# Off a terminal the logs are JSON lines anyway; said here for whoever reads the image.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TOOLLEDGER_LOG_FORMAT=json

WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
COPY migrations ./migrations
COPY examples ./examples
# The example tool set ships in the package (toolledger.examples.shop); put your own tools'
# package on PYTHONPATH (a volume, or a FROM toolledger image that installs it).
RUN pip install . && useradd --system --uid 10001 toolledger

USER toolledger
ENTRYPOINT ["toolledger"]
CMD ["--help"]
