// Command mkimage writes the images of the real-runtime box as one OCI image archive that
// `ctr images import` reads, since no registry is reachable from the build machines: one layer
// holding the probe binary (cmd/probe) under each name it answers to, and one image per name
// given, each with its own entrypoint.
//
// Usage: mkimage PROBE OUT.tar NAME=ENTRYPOINT...
//
// For example `registry.k8s.io/pause:3.10.1=/pause` and `registry.example/probe:1=/probe`.
// NAME is a full reference (registry, path, tag), as containerd's CRI plugin stores it. The
// archive is the same for the same inputs: every time stamp is zero.
package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"
)

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int               `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Platform    map[string]string `json:"platform,omitempty"`
}

type blob struct {
	digest string
	data   []byte
}

func newBlob(data []byte) blob {
	sum := sha256.Sum256(data)
	return blob{digest: "sha256:" + hex.EncodeToString(sum[:]), data: data}
}

func main() {
	if len(os.Args) < 4 {
		fmt.Fprintln(os.Stderr, "usage: mkimage PROBE OUT.tar NAME=ENTRYPOINT...")
		os.Exit(2)
	}
	if err := run(os.Args[1], os.Args[2], os.Args[3:]); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

func run(probePath, out string, images []string) error {
	probe, err := os.ReadFile(probePath)
	if err != nil {
		return err
	}
	layer, err := rootfs(probe)
	if err != nil {
		return err
	}
	blobs := []blob{layer}
	var manifests []descriptor
	for _, image := range images {
		name, entry, ok := strings.Cut(image, "=")
		if !ok || name == "" || !strings.HasPrefix(entry, "/") {
			return fmt.Errorf("%q is not NAME=/ENTRYPOINT", image)
		}
		config, err := json.Marshal(map[string]any{
			"architecture": "amd64",
			"os":           "linux",
			"config":       map[string]any{"Entrypoint": []string{entry}, "Env": []string{"PATH=/bin"}},
			"rootfs":       map[string]any{"type": "layers", "diff_ids": []string{layer.digest}},
		})
		if err != nil {
			return err
		}
		cfg := newBlob(config)
		manifest, err := json.Marshal(map[string]any{
			"schemaVersion": 2,
			"mediaType":     "application/vnd.oci.image.manifest.v1+json",
			"config":        descriptor{MediaType: "application/vnd.oci.image.config.v1+json", Digest: cfg.digest, Size: len(cfg.data)},
			"layers":        []descriptor{{MediaType: "application/vnd.oci.image.layer.v1.tar", Digest: layer.digest, Size: len(layer.data)}},
		})
		if err != nil {
			return err
		}
		m := newBlob(manifest)
		blobs = append(blobs, cfg, m)
		tag := name[strings.LastIndex(name, ":")+1:]
		manifests = append(manifests, descriptor{
			MediaType:   "application/vnd.oci.image.manifest.v1+json",
			Digest:      m.digest,
			Size:        len(m.data),
			Annotations: map[string]string{"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag},
			Platform:    map[string]string{"architecture": "amd64", "os": "linux"},
		})
	}
	index, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.index.v1+json",
		"manifests":     manifests,
	})
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	w := tar.NewWriter(&buf)
	files := []struct {
		name string
		data []byte
	}{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", index},
	}
	seen := map[string]bool{}
	for _, b := range blobs {
		if seen[b.digest] {
			continue
		}
		seen[b.digest] = true
		files = append(files, struct {
			name string
			data []byte
		}{"blobs/sha256/" + strings.TrimPrefix(b.digest, "sha256:"), b.data})
	}
	for _, dir := range []string{"blobs/", "blobs/sha256/"} {
		if err := w.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir, Mode: 0o755, ModTime: time.Unix(0, 0)}); err != nil {
			return err
		}
	}
	for _, f := range files {
		if err := w.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: f.name, Mode: 0o644, Size: int64(len(f.data)), ModTime: time.Unix(0, 0)}); err != nil {
			return err
		}
		if _, err := w.Write(f.data); err != nil {
			return err
		}
	}
	if err := w.Close(); err != nil {
		return err
	}
	return os.WriteFile(out, buf.Bytes(), 0o644)
}

// rootfs is the images' one layer: the probe at /probe, linked as /pause, /bin/sleep and
// /bin/true, and the directories a container's mounts land on.
func rootfs(probe []byte) (blob, error) {
	var buf bytes.Buffer
	w := tar.NewWriter(&buf)
	epoch := time.Unix(0, 0)
	for _, dir := range []string{"bin/", "dev/", "etc/", "proc/", "sys/", "run/"} {
		if err := w.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir, Mode: 0o755, ModTime: epoch}); err != nil {
			return blob{}, err
		}
	}
	if err := w.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777, ModTime: epoch}); err != nil {
		return blob{}, err
	}
	if err := w.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "probe", Mode: 0o755, Size: int64(len(probe)), ModTime: epoch}); err != nil {
		return blob{}, err
	}
	if _, err := w.Write(probe); err != nil {
		return blob{}, err
	}
	for _, link := range []string{"pause", "bin/sleep", "bin/true", "bin/probe"} {
		if err := w.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: link, Linkname: "/probe", Mode: 0o777, ModTime: epoch}); err != nil {
			return blob{}, err
		}
	}
	if err := w.Close(); err != nil {
		return blob{}, err
	}
	return newBlob(buf.Bytes()), nil
}
