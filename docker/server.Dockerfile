# The rankscope server image: processors, sink and dashboard (`pip install rankscope[server]`).
# No torch and no test tools: ranks install `rankscope` into their own training image instead.
# Built by docker-compose.yml; every service runs `rankscope <command>`.
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY rankscope rankscope
COPY producers producers
COPY stream_processors stream_processors
COPY offline offline
COPY cli cli
COPY storage storage
COPY dashboard dashboard
RUN pip wheel --no-cache-dir --no-deps -w /dist .

FROM python:3.11-slim
COPY requirements.lock /tmp/requirements.lock
COPY --from=wheel /dist /tmp/dist
# requirements.lock pins the versions the suite runs against (a constraints file installs nothing itself).
RUN pip install --no-cache-dir -c /tmp/requirements.lock "$(ls /tmp/dist/rankscope-*.whl)[server]" \
    && rm -rf /tmp/dist /tmp/requirements.lock \
    && useradd --create-home --uid 10001 rankscope \
    && mkdir -p /var/lib/rankscope && chown rankscope /var/lib/rankscope
USER rankscope
WORKDIR /var/lib/rankscope
ENV RANKSCOPE_DATA_DIR=/var/lib/rankscope PYTHONUNBUFFERED=1
ENTRYPOINT ["rankscope"]
CMD ["--help"]
