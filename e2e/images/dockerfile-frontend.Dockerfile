# docker/dockerfile:1, the BuildKit Dockerfile frontend the Dockerfile's `# syntax=` line names,
# assembled where Docker Hub cannot be reached (e2e/base-images.sh): BuildKit's own
# frontend/dockerfile/cmd/dockerfile-frontend, built from the Go module proxy, in the image layout
# and with the labels of BuildKit's release Dockerfile for it.
FROM scratch
LABEL moby.buildkit.frontend.network.none="true"
LABEL moby.buildkit.frontend.caps="moby.buildkit.frontend.inputs,moby.buildkit.frontend.subrequests,moby.buildkit.frontend.contexts,moby.buildkit.frontend.gitquerystring,moby.buildkit.frontend.contexts.zstd"
COPY dockerfile-frontend /bin/dockerfile-frontend
ENTRYPOINT ["/bin/dockerfile-frontend"]
