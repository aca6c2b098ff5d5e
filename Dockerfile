# toolledger: one image for migrate, serve, api and the emulator (the command picks which).
FROM python:3.11-slim

# Off a terminal the logs are JSON lines anyway; said here for whoever reads the image.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TOOLLEDGER_LOG_FORMAT=json

WORKDIR /app
COPY pyproject.toml README.md ./
# The versions CI tested, not whatever is newest on the day the image is built.
COPY .ci/constraints.txt ./constraints.txt
COPY src ./src
COPY migrations ./migrations
COPY examples ./examples
# The example tool set ships in the package (toolledger.examples.shop); your own tools' package
# goes on PYTHONPATH (docker-compose.yml mounts its folder at /srv/app), or in a FROM toolledger
# image that installs it.
RUN pip install . -c constraints.txt && useradd --system --uid 10001 toolledger \
    && mkdir -p /var/lib/toolledger-shop && chown toolledger /var/lib/toolledger-shop

USER toolledger
ENTRYPOINT ["toolledger"]
CMD ["--help"]
