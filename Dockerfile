# Build: docker build --build-arg VERSION=$(git describe --always) -t pullproxy .
# Run:   docker run -p 5000:5000 -v pullproxy:/var/lib/pullproxy pullproxy
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
# Pure Go (Badger included): a static binary for a distroless image.
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/pullproxy ./cmd/pullproxy \
 && mkdir -p /out/data

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/pullproxy /usr/local/bin/pullproxy
# Owned by distroless's nonroot user, so a fresh volume is writable.
COPY --from=build --chown=65532:65532 /out/data /var/lib/pullproxy
VOLUME /var/lib/pullproxy
EXPOSE 5000
ENTRYPOINT ["/usr/local/bin/pullproxy"]
CMD ["serve", "--listen", ":5000", "--data-dir", "/var/lib/pullproxy"]
