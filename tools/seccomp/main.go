// Command seccomp writes deploy/seccomp/tracejoin.json, the agent's Localhost seccomp profile.
//
// The profile is derived, not hand-written: it is containerd's RuntimeDefault (the profile a
// Kubernetes pod gets on containerd with seccompProfile: RuntimeDefault, from
// github.com/containerd/containerd/v2/contrib/seccomp at the version pinned in go.mod),
// generated for a container whose capability set is the agent's required one
// (CAP_BPF, CAP_PERFMON), then:
//
//   - bpf and perf_event_open are allowed unconditionally, so the profile does not depend on a
//     runtime that gates them by capability (containerd >= 1.7 and Docker >= 23 allow them with
//     CAP_BPF / CAP_PERFMON; CRI-O and older runtimes only with CAP_SYS_ADMIN). The kernel still
//     checks the capabilities;
//   - ptrace, process_vm_readv, process_vm_writev, kcmp, pidfd_getfd, process_madvise and
//     open_by_handle_at are removed from every rule, so they fail with EPERM even when the pod
//     is granted CAP_SYS_PTRACE or CAP_DAC_READ_SEARCH (the agent reads /proc, it never
//     attaches to, reads the memory of, or opens by handle another process's files).
//
// The output is the OCI runtime-spec LinuxSeccomp JSON, which containerd reads for a Localhost
// profile as is, and which CRI-O and Docker (whose format is a superset) read too. It covers
// x86_64 (with its x86 and x32 sub-architectures, as the runtime default does) and aarch64
// (with arm): the generator runs on amd64, so the aarch64-only syscalls are listed below.
//
// Usage: scripts/seccomp-profile.sh (builds this with build.sh and writes every copy).
// tests/test_deploy.py re-runs it and requires the committed file to be identical.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"slices"

	"github.com/containerd/containerd/v2/contrib/seccomp"
	"github.com/opencontainers/runtime-spec/specs-go"
)

// The agent's required capabilities: what RuntimeDefault is generated for.
var capabilities = []string{"CAP_BPF", "CAP_PERFMON"}

// Allowed whatever the runtime's capability gating: what loading and attaching the probes needs.
var added = []string{"bpf", "perf_event_open"}

// Never allowed, whatever capabilities the pod is granted.
var denied = []string{
	"kcmp",
	"open_by_handle_at",
	"pidfd_getfd",
	"process_madvise",
	"process_vm_readv",
	"process_vm_writev",
	"ptrace",
}

// The runtime default's arm/arm64-only syscalls (contrib/seccomp, the "arm", "arm64" case),
// which a profile generated on amd64 lacks. A name a node's architecture does not have is
// skipped by the runtime when it builds the filter.
var arm64Only = []string{
	"arm_fadvise64_64",
	"arm_sync_file_range",
	"breakpoint",
	"cacheflush",
	"set_tls",
	"sync_file_range2",
}

func main() {
	if runtime.GOARCH != "amd64" {
		fmt.Fprintln(os.Stderr, "seccomp: run on amd64 (the aarch64 additions are listed by hand)")
		os.Exit(2)
	}
	spec := &specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{
		Bounding: capabilities, Effective: capabilities, Permitted: capabilities,
	}}}
	p := seccomp.DefaultProfile(spec)
	p.Architectures = append(p.Architectures, specs.ArchAARCH64, specs.ArchARM)

	var rules []specs.LinuxSyscall
	for _, r := range p.Syscalls {
		r.Names = slices.DeleteFunc(slices.Clone(r.Names), func(n string) bool {
			return slices.Contains(denied, n) || slices.Contains(added, n)
		})
		if len(r.Names) > 0 {
			rules = append(rules, r)
		}
	}
	rules = append(rules,
		specs.LinuxSyscall{Names: arm64Only, Action: specs.ActAllow},
		specs.LinuxSyscall{Names: added, Action: specs.ActAllow},
	)
	p.Syscalls = rules

	out, err := json.MarshalIndent(p, "", "  ")
	if err != nil {
		fmt.Fprintln(os.Stderr, "seccomp:", err)
		os.Exit(1)
	}
	fmt.Println(string(out))
}
