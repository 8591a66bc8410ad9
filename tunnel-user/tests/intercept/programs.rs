//! The programs themselves: all detached on drop, and working beside another
//! program on the same hook.

use super::*;

/// Program names attached to a cgroup, as the kernel reports them (bpftool prints at
/// most 15 characters of a name, the kernel's limit).
fn attached_programs(cgroup: &std::path::Path) -> Result<String, String> {
    let out = Command::new("bpftool")
        .args(["cgroup", "show"])
        .arg(cgroup)
        .output()
        .map_err(|e| format!("bpftool (installed by scripts/setup.sh): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "bpftool cgroup show: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test]
async fn drop_detaches_every_program() {
    let Some((cgroup, interceptor)) =
        setup(|cg| config(cg, SocketAddr::from(([127, 0, 0, 1], 1)), vec![EDGE_PORT]))
    else {
        return;
    };
    let attached = match attached_programs(&cgroup.path) {
        Ok(a) => a,
        Err(e) => {
            cannot_run(&e);
            return;
        }
    };
    for name in PROGRAM_NAMES {
        assert!(attached.contains(name), "{name} attached: {attached}");
    }
    drop(interceptor);
    let attached = attached_programs(&cgroup.path).expect("bpftool");
    for name in PROGRAM_NAMES {
        assert!(
            !attached.contains(name),
            "{name} still attached after drop: {attached}"
        );
    }
}

/// A neighbour's `connect4` program, as Cilium's socket load balancer attaches one at the
/// same cgroup (`BPF_F_ALLOW_MULTI`, no bpf link): it rewrites connects to one address
/// (a "ClusterIP") to another (a "backend"). Hand-assembled so that nothing of ours is
/// in it; detached when dropped.
struct NeighbourConnect4 {
    prog: std::os::fd::OwnedFd,
    cgroup: std::fs::File,
}

const BPF_PROG_LOAD: libc::c_long = 5;

const BPF_PROG_ATTACH: libc::c_long = 8;

const BPF_PROG_DETACH: libc::c_long = 9;

const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;

const BPF_CGROUP_INET4_CONNECT: u32 = 10;

const BPF_F_ALLOW_MULTI: u32 = 2;

/// `union bpf_attr`, as bytes: each command fills the fields it uses.
#[repr(C, align(8))]
struct BpfAttr([u8; 128]);

impl BpfAttr {
    fn put_u32(&mut self, at: usize, v: u32) {
        self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    }
    fn put_u64(&mut self, at: usize, v: u64) {
        self.0[at..at + 8].copy_from_slice(&v.to_ne_bytes());
    }
}

fn bpf(cmd: libc::c_long, attr: &mut BpfAttr) -> std::io::Result<i32> {
    // SAFETY: attr is a zero-padded bpf_attr of the size we pass; pointers in it point
    // to buffers alive for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.0.as_mut_ptr(),
            std::mem::size_of::<BpfAttr>(),
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc as i32)
    }
}

/// One BPF instruction: opcode, dst/src registers, offset, immediate.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    let regs = (src << 4) | dst;
    u64::from(code)
        | (u64::from(regs) << 8)
        | (u64::from(off as u16) << 16)
        | (u64::from(imm as u32) << 32)
}

impl NeighbourConnect4 {
    fn attach(cgroup: &std::path::Path, from: Ipv4Addr, to: SocketAddrV4) -> std::io::Result<Self> {
        // struct bpf_sock_addr: user_ip4 at 4, user_port at 24, both network order.
        let ip = |a: Ipv4Addr| u32::from_ne_bytes(a.octets()) as i32;
        let port = u32::from(to.port().to_be()) as i32;
        let code: [u64; 8] = [
            insn(0x61, 2, 1, 4, 0),            // w2 = ctx->user_ip4
            insn(0x55, 2, 0, 4, ip(from)),     // if r2 != from goto allow
            insn(0xb4, 3, 0, 0, ip(*to.ip())), // w3 = to.ip
            insn(0x63, 1, 3, 4, 0),            // ctx->user_ip4 = w3
            insn(0xb4, 3, 0, 0, port),         // w3 = to.port
            insn(0x63, 1, 3, 24, 0),           // ctx->user_port = w3
            insn(0xb7, 0, 0, 0, 1),            // allow: r0 = 1
            insn(0x95, 0, 0, 0, 0),            // exit
        ];
        let license = c"GPL";
        let mut attr = BpfAttr([0; 128]);
        attr.put_u32(0, BPF_PROG_TYPE_CGROUP_SOCK_ADDR);
        attr.put_u32(4, code.len() as u32);
        attr.put_u64(8, code.as_ptr() as u64);
        attr.put_u64(16, license.as_ptr() as u64);
        attr.put_u32(68, BPF_CGROUP_INET4_CONNECT); // expected_attach_type
        let fd = bpf(BPF_PROG_LOAD, &mut attr)?;
        // SAFETY: a new fd the kernel just returned, owned from here on.
        let prog = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let cgroup = std::fs::File::open(cgroup)?;
        let mut attr = Self::attach_attr(&cgroup, &prog, BPF_F_ALLOW_MULTI);
        bpf(BPF_PROG_ATTACH, &mut attr)?;
        Ok(Self { prog, cgroup })
    }

    fn attach_attr(cgroup: &std::fs::File, prog: &std::os::fd::OwnedFd, flags: u32) -> BpfAttr {
        use std::os::fd::AsRawFd as _;
        let mut attr = BpfAttr([0; 128]);
        attr.put_u32(0, cgroup.as_raw_fd() as u32);
        attr.put_u32(4, prog.as_raw_fd() as u32);
        attr.put_u32(8, BPF_CGROUP_INET4_CONNECT);
        attr.put_u32(12, flags);
        attr
    }
}

impl Drop for NeighbourConnect4 {
    fn drop(&mut self) {
        let mut attr = Self::attach_attr(&self.cgroup, &self.prog, 0);
        if let Err(e) = bpf(BPF_PROG_DETACH, &mut attr) {
            eprintln!("detaching the neighbour connect4 program: {e}");
        }
    }
}

/// Another `connect4` program multi-attached at the same cgroup (as Cilium's socket load
/// balancer is) keeps working for its own destination, and ours for edge destinations,
/// whichever attached first.
#[tokio::test]
async fn a_neighbour_connect4_program_and_ours_both_work_side_by_side() {
    const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(127, 2, 0, 9);
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let backend = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let SocketAddr::V4(backend_addr) = backend.local_addr().expect("addr") else {
        panic!("v4 backend")
    };
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some(root) = cgroup_root(NEEDS) else {
        return;
    };
    let cgroup = TestCgroup::new(&root).expect("create test cgroup");
    // The neighbour first (as on a node where Cilium runs before us), then ours.
    let neighbour = match NeighbourConnect4::attach(&cgroup.path, CLUSTER_IP, backend_addr) {
        Ok(n) => n,
        Err(e) => panic!("loading/attaching the neighbour connect4 program: {e}"),
    };
    let Some(interceptor) = attach(&config(&cgroup, redirect_addr, vec![EDGE_PORT])) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");
    let attached = attached_programs(&cgroup.path).expect("bpftool");
    assert_eq!(
        attached
            .lines()
            .filter(|l| l.contains("inet4_connect"))
            .count(),
        2,
        "both connect4 programs attached: {attached}"
    );

    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", EDGE_PORT),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(
        server, "orig 127.1.0.5:10250",
        "ours redirects edge connects"
    );
    assert!(client.contains("peer 127.1.0.5:10250"), "{client}");
    assert!(client.contains("server orig 127.1.0.5:10250"), "{client}");

    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.2.0.9", 80),
        serve_one(&backend, None),
    );
    assert_eq!(server, "direct", "the neighbour's backend is reached");
    assert!(client.contains("server direct"), "{client}");
    assert_eq!(interceptor.counters().errors, 0);

    // Ours leaving does not take the neighbour's program with it.
    drop(interceptor);
    let attached = attached_programs(&cgroup.path).expect("bpftool");
    assert_eq!(
        attached
            .lines()
            .filter(|l| l.contains("inet4_connect"))
            .count(),
        1,
        "{attached}"
    );
    let (client, _) = tokio::join!(
        python_client(&cgroup, "127.2.0.9", 80),
        serve_one(&backend, None),
    );
    assert!(client.contains("server direct"), "{client}");
    drop(neighbour);
}
