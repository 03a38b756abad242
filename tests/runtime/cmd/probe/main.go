// Command probe is the process of every container the real-runtime box starts: it reports on
// its standard output, as one line, what the process itself sees (its environment, its device
// nodes, its mounts, its cgroups), so that a test reads what reached the process rather than
// what the kubelet asked for. It is also the box's pause image.
//
// What it does depends on the name it is run by (the image links every name to it):
//
//	pause    waits for SIGTERM or SIGINT and exits 0 (the pod sandbox)
//	true     reports, lingers 200 ms (its runtime copies the line to the log while it lives:
//	         an init container's report is not left to the copy after its exit), exits 0
//	sleep    reports and waits for SIGTERM or SIGINT, then exits 0 (`sleep infinity`)
//	probe    the same as sleep (the probe image's entrypoint)
//
// The report is the line `gpushare-probe {json}`. Where the environment has PROBE_WRITE, a
// colon-separated list of directories, the probe also tries to create a file in each and
// reports, per directory, "ok" (the file is removed again) or the error: whether the process
// itself can write there (an MPS client and its pipe directory).
package main

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"
)

// Device is one device node under /dev.
type Device struct {
	Path  string `json:"path"`
	Kind  string `json:"kind"` // "c" or "b"
	Major uint32 `json:"major"`
	Minor uint32 `json:"minor"`
}

// Mount is one line of /proc/self/mounts.
type Mount struct {
	Source  string `json:"source"`
	Target  string `json:"target"`
	FSType  string `json:"fstype"`
	Options string `json:"options"`
}

// Report is what the process saw.
type Report struct {
	Args    []string          `json:"args"`
	Env     map[string]string `json:"env"`
	Devices []Device          `json:"devices"`
	Mounts  []Mount           `json:"mounts"`
	Cgroup  string            `json:"cgroup"`
	UID     int               `json:"uid"`
	PID     int               `json:"pid"`
	Writes  map[string]string `json:"writes,omitempty"`
}

func main() {
	name := filepath.Base(os.Args[0])
	switch name {
	case "pause":
		wait()
		return
	case "true":
		report()
		time.Sleep(200 * time.Millisecond)
		return
	default:
		report()
		wait()
	}
}

func wait() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}

func report() {
	r := Report{Args: os.Args, Env: map[string]string{}, UID: os.Getuid(), PID: os.Getpid()}
	for _, kv := range os.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		r.Env[k] = v
	}
	_ = filepath.WalkDir("/dev", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		var st syscall.Stat_t
		if syscall.Lstat(path, &st) != nil {
			return nil
		}
		kind := ""
		switch st.Mode & syscall.S_IFMT {
		case syscall.S_IFCHR:
			kind = "c"
		case syscall.S_IFBLK:
			kind = "b"
		default:
			return nil
		}
		r.Devices = append(r.Devices, Device{Path: path, Kind: kind, Major: major(st.Rdev), Minor: minor(st.Rdev)})
		return nil
	})
	sort.Slice(r.Devices, func(i, j int) bool { return r.Devices[i].Path < r.Devices[j].Path })
	if b, err := os.ReadFile("/proc/self/mounts"); err == nil {
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			f := strings.Fields(line)
			if len(f) >= 4 {
				r.Mounts = append(r.Mounts, Mount{Source: f[0], Target: f[1], FSType: f[2], Options: f[3]})
			}
		}
	}
	if dirs := os.Getenv("PROBE_WRITE"); dirs != "" {
		r.Writes = map[string]string{}
		for _, dir := range strings.Split(dirs, ":") {
			r.Writes[dir] = tryWrite(dir)
		}
	}
	if b, err := os.ReadFile("/proc/self/cgroup"); err == nil {
		r.Cgroup = strings.TrimSpace(string(b))
	}
	out, err := json.Marshal(r)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gpushare-probe:", err)
		os.Exit(1)
	}
	fmt.Printf("gpushare-probe %s\n", out)
}

// tryWrite creates a file in dir and removes it: "ok", or the error that stopped it.
func tryWrite(dir string) string {
	f, err := os.CreateTemp(dir, "probe-")
	if err != nil {
		return err.Error()
	}
	name := f.Name()
	f.Close()
	if err := os.Remove(name); err != nil {
		return "written, but not removed: " + err.Error()
	}
	return "ok"
}

func major(dev uint64) uint32 { return uint32((dev>>8)&0xfff) | uint32((dev>>32)&^0xfff) }
func minor(dev uint64) uint32 { return uint32(dev&0xff) | uint32((dev>>12)&^0xff) }
