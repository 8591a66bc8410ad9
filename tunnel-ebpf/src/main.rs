//! Transparent redirect of `connect()` to edge targets into tunnel-cloud.
//!
//! - `cgroup/connect4`: an edge target (ip, port) is rewritten to the redirect listener;
//!   the original destination is kept by socket cookie, because the socket has no
//!   source port yet at this point.
//! - `sockops` (ACTIVE_ESTABLISHED): the entry is copied to a map keyed by the client's
//!   (local ip, local port), i.e. the peer address tunnel-cloud sees on `accept()`.
//!   The callback runs while the client processes the SYN-ACK, before it sends the ACK
//!   that puts the connection in the listener's accept queue, so the entry exists before
//!   `accept()` can return it.
//! - `sockops` (STATE_CB, TCP_CLOSE): both entries go when the client socket closes.
//! - `cgroup/getpeername4`: the client sees the address it dialled, not the listener.
//! - `cgroup/connect6`, `cgroup/getpeername6`: the same for AF_INET6 sockets, both for
//!   IPv6 edges (the `*6` maps, redirected to the IPv6 listener) and for IPv4 edges
//!   dialled as `::ffff:a.b.c.d` (the IPv4 maps and listener, as connect4 does).
//!
//! Every program fails open: on any error the connect goes ahead unchanged and the
//! `Errors` counter moves. So does connect4/6 once the owning tunnel-cloud has stopped
//! pushing `ALIVE_UNTIL` forward.
//!
//! The one connect they deny: to an edge target the cloud marked
//! [`EdgeState::NoTunnel`] (no replica holds its node's tunnel, as the cloud knows for
//! sure), while the cloud is alive. It fails at once with `EHOSTDOWN` set by
//! `bpf_set_retval` (Linux 5.18+), so the client's error says "host is down" where a
//! redirect would only have been reset by a cloud with nowhere to send it. Kernels
//! without the helper load `connect4_reset`/`connect6_reset` instead, the same
//! programs that redirect such a connect as before (the cloud then resets it).
//!
//! Records go through `aya-log` (a ring buffer the loader forwards into `tracing`), at
//! most as verbose as `Config::log_level`, which the loader keeps in step with its log
//! filter: a redirect at debug, every error path at warn.
#![no_std]
#![no_main]

use core::ffi::c_void;

use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG,
        BPF_TCP_CLOSE,
    },
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns,
        bpf_set_retval,
    },
    macros::{cgroup_sock_addr, map, sock_ops},
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
    programs::{SockAddrContext, SockOpsContext},
};
use aya_log_ebpf::{debug, warn};
use tunnel_common::{
    COUNTERS_LEN, Config, Counter, EDGES_MAX, EdgeState, Endpoint, Endpoint6, LogLevel,
    NO_TUNNEL_ERRNO, ORIG_MAX,
};

// Not in aya-ebpf's bindings (they come from <linux/socket.h>, not <linux/bpf.h>).
const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;
const SOCK_STREAM: u32 = 1;

/// Return value that lets a cgroup sock_addr syscall proceed.
const ALLOW: i32 = 1;
/// Return value that fails it: with the errno `bpf_set_retval` set, else EPERM.
const DENY: i32 = 0;

#[map]
static EDGES: HashMap<Endpoint, u32> = HashMap::with_max_entries(EDGES_MAX, 0);

#[map]
static ORIG_BY_COOKIE: LruHashMap<u64, Endpoint> = LruHashMap::with_max_entries(ORIG_MAX, 0);

#[map]
static ORIG_BY_PEER: LruHashMap<Endpoint, Endpoint> = LruHashMap::with_max_entries(ORIG_MAX, 0);

#[map]
static EDGES6: HashMap<Endpoint6, u32> = HashMap::with_max_entries(EDGES_MAX, 0);

#[map]
static ORIG6_BY_COOKIE: LruHashMap<u64, Endpoint6> = LruHashMap::with_max_entries(ORIG_MAX, 0);

#[map]
static ORIG6_BY_PEER: LruHashMap<Endpoint6, Endpoint6> = LruHashMap::with_max_entries(ORIG_MAX, 0);

#[map]
static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

#[map]
static ALIVE_UNTIL: Array<u64> = Array::with_max_entries(1, 0);

#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTERS_LEN, 0);

#[inline(always)]
fn count(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // Per-CPU slot: programs on one CPU do not preempt each other here, so a plain
        // add is enough and avoids an atomic on every connect() in the cgroup.
        // SAFETY: `slot` points into this CPU's counter array, from the lookup just above.
        unsafe { *slot += 1 };
    }
}

/// Why a program failed open: logged at warn, and the `Errors` counter moves.
struct Failed(&'static str);

/// Whether records at `level` are wanted now (`Config::log_level`).
#[inline(always)]
fn log_enabled(level: LogLevel) -> bool {
    CONFIG
        .get(0)
        .is_some_and(|cfg| cfg.log_level >= level as u32)
}

/// Counts the outcome of a sock_addr program and logs a failure.
#[inline(always)]
fn finish(ctx: &SockAddrContext, outcome: Result<Counter, Failed>) {
    let counter = match outcome {
        Ok(counter) => counter,
        Err(Failed(why)) => {
            if log_enabled(LogLevel::Warn) {
                warn!(ctx, "connect to an edge left unchanged: {}", why);
            }
            Counter::Errors
        }
    };
    count(counter);
}

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    verdict(&ctx, try_connect4::<true>(&ctx))
}

/// AF_INET6 sockets run connect6, not connect4: IPv6 edges, and IPv4 edges dialled as
/// `::ffff:a.b.c.d` by dual-stack clients such as Java's.
#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    verdict(&ctx, try_connect6::<true>(&ctx))
}

/// connect4 for kernels without `bpf_set_retval` (before 5.18): a target without a
/// tunnel is redirected like any other, and the cloud resets the connection.
#[cgroup_sock_addr(connect4)]
pub fn connect4_reset(ctx: SockAddrContext) -> i32 {
    verdict(&ctx, try_connect4::<false>(&ctx))
}

/// connect6 for kernels without `bpf_set_retval`, as [`connect4_reset`].
#[cgroup_sock_addr(connect6)]
pub fn connect6_reset(ctx: SockAddrContext) -> i32 {
    verdict(&ctx, try_connect6::<false>(&ctx))
}

/// Counts the outcome and answers the kernel: a connect to a target without a tunnel
/// fails with `EHOSTDOWN`, every other goes ahead (rewritten or not).
#[inline(always)]
fn verdict(ctx: &SockAddrContext, outcome: Result<Counter, Failed>) -> i32 {
    let refused = matches!(outcome, Ok(Counter::NoTunnel));
    finish(ctx, outcome);
    if refused {
        // SAFETY: a BPF helper that only sets this syscall's return value.
        unsafe { bpf_set_retval(-NO_TUNNEL_ERRNO) };
        return DENY;
    }
    ALLOW
}

/// `REFUSE`: whether a target without a tunnel is refused (`Counter::NoTunnel`, which
/// only the programs with `bpf_set_retval` may return) or redirected.
fn try_connect4<const REFUSE: bool>(ctx: &SockAddrContext) -> Result<Counter, Failed> {
    let sa = ctx.sock_addr;
    // user_ip4 is network order; user_port holds the network-order port in its low 16
    // bits (the verifier only allows 4-byte access to it).
    // SAFETY: `sock_addr` is the kernel's context of this call; the verifier checks each
    // field access (offset and size).
    let (ip, port) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
    let dst = Endpoint::new(u32::from_be(ip), u16::from_be(port as u16));
    Ok(redirect_target::<V4, REFUSE>(ctx, dst)?.apply(|target| {
        // SAFETY: `sock_addr` is the kernel's context of this call; the verifier checks
        // each field access (offset and size).
        unsafe {
            (*sa).user_ip4 = target.ip.to_be();
            (*sa).user_port = u32::from(target.port.to_be());
        }
    }))
}

/// As [`try_connect4`], for AF_INET6 sockets.
fn try_connect6<const REFUSE: bool>(ctx: &SockAddrContext) -> Result<Counter, Failed> {
    let sa = ctx.sock_addr;
    // SAFETY: `sock_addr` is the kernel's context of this call; the verifier checks each
    // field access (offset and size).
    let (ip6, port) = unsafe { ((*sa).user_ip6, (*sa).user_port) };
    let port = u16::from_be(port as u16);
    let Some(ip4) = v4_mapped(ip6) else {
        return Ok(
            redirect_target::<V6, REFUSE>(ctx, Endpoint6::new(ip6, port))?
                .apply(|target| set_ip6(ctx, target)),
        );
    };
    Ok(
        redirect_target::<V4, REFUSE>(ctx, Endpoint::new(ip4, port))?
            .apply(|target| set_v4_mapped(ctx, target)),
    )
}

/// `::ffff:a.b.c.d` (words in network order) -> a.b.c.d in host order.
#[inline(always)]
fn v4_mapped(ip6: [u32; 4]) -> Option<u32> {
    (ip6[0] == 0 && ip6[1] == 0 && ip6[2] == 0xffff_u32.to_be()).then(|| u32::from_be(ip6[3]))
}

/// Writes `::ffff:<ep.ip>` and the port into a v6 sockaddr. Word by word: the verifier
/// allows only 4-byte stores into user_ip6.
#[inline(always)]
fn set_v4_mapped(ctx: &SockAddrContext, ep: Endpoint) {
    let sa = ctx.sock_addr;
    // SAFETY: `sock_addr` is the kernel's context of this call; the verifier checks each
    // field access (offset and size).
    unsafe {
        (*sa).user_ip6[0] = 0;
        (*sa).user_ip6[1] = 0;
        (*sa).user_ip6[2] = 0xffff_u32.to_be();
        (*sa).user_ip6[3] = ep.ip.to_be();
        (*sa).user_port = u32::from(ep.port.to_be());
    }
}

/// Writes an IPv6 address and port into a v6 sockaddr, word by word (see above).
#[inline(always)]
fn set_ip6(ctx: &SockAddrContext, ep: Endpoint6) {
    let sa = ctx.sock_addr;
    // SAFETY: `sock_addr` is the kernel's context of this call; the verifier checks each
    // field access (offset and size).
    unsafe {
        (*sa).user_ip6[0] = ep.ip[0];
        (*sa).user_ip6[1] = ep.ip[1];
        (*sa).user_ip6[2] = ep.ip[2];
        (*sa).user_ip6[3] = ep.ip[3];
        (*sa).user_port = u32::from(ep.port.to_be());
    }
}

/// The config, when a TCP connect by a client outside the exempt cgroup may be
/// redirected at all; `None` = leave it alone.
#[inline(always)]
fn redirectable() -> Result<Option<&'static Config>, Failed> {
    let cfg = CONFIG.get(0).ok_or(Failed("no config entry"))?;
    // No tunnel-cloud has vouched for this redirect lately: it crashed for good or was
    // removed without uninstalling. Fail open, so clients reach what they dialled instead
    // of a listener that is gone.
    let alive_until = ALIVE_UNTIL.get(0).copied().unwrap_or(0);
    // SAFETY: a BPF helper that only reads the current task's or the program context's
    // state.
    if unsafe { bpf_ktime_get_ns() } > alive_until {
        return Ok(None);
    }
    // tunnel-cloud's own dials (and anything else in its cgroup) go where they asked,
    // or the tunnel would loop into itself.
    // SAFETY: a BPF helper that only reads the current task's or the program context's
    // state.
    if cfg.exempt_cgroup_id != 0 && unsafe { bpf_get_current_cgroup_id() } == cfg.exempt_cgroup_id {
        return Ok(None);
    }
    Ok(Some(cfg))
}

/// TCP only: a UDP "connect" to an edge address must not land on a TCP listener, and UDP
/// sockets never reach sock_ops, so their cookie entries would only linger.
#[inline(always)]
fn is_tcp(ctx: &SockAddrContext) -> bool {
    // SAFETY: `sock_addr` is the kernel's context of this call; the verifier checks each
    // field access (offset and size).
    let type_ = unsafe { (*ctx.sock_addr).type_ };
    type_ == SOCK_STREAM
}

/// A client in another network namespace (a pod) cannot reach the host's loopback
/// listener, so it goes to the pod redirect address (the node IP) instead.
#[inline(always)]
fn in_host_netns(ctx: &SockAddrContext, cfg: &Config) -> bool {
    // SAFETY: a BPF helper that only reads the current task's or the program context's
    // state.
    let cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    cookie == cfg.host_netns_cookie
}

/// What differs between IPv4 and IPv6 for the programs here: the endpoint type, its
/// maps, the redirect listeners, how the client's address is read and how a redirect is
/// logged. One copy of each program's logic ([`redirect_target`], [`on_established`],
/// [`on_state_change`]) serves both.
trait Family {
    type Endpoint: Copy + 'static;
    fn edges() -> &'static HashMap<Self::Endpoint, u32>;
    fn orig_by_cookie() -> &'static LruHashMap<u64, Self::Endpoint>;
    fn orig_by_peer() -> &'static LruHashMap<Self::Endpoint, Self::Endpoint>;
    /// The redirect listener for a client in the host's network namespace, or in a pod's;
    /// `None` when that one is not set.
    fn redirect(cfg: &Config, in_host_netns: bool) -> Option<Self::Endpoint>;
    /// The client's own address: what the listener's `accept()` reports as the peer.
    fn client(ctx: &SockOpsContext) -> Self::Endpoint;
    fn log_redirected(ctx: &SockAddrContext, dst: Self::Endpoint, to: Self::Endpoint, cookie: u64);
    fn log_no_tunnel(ctx: &SockAddrContext, dst: Self::Endpoint);
    const NO_REDIRECT: &'static str;
    const NOT_RECORDED: &'static str;
    const NOT_STORED: &'static str;
}

struct V4;
struct V6;

impl Family for V4 {
    type Endpoint = Endpoint;
    fn edges() -> &'static HashMap<Endpoint, u32> {
        &EDGES
    }
    fn orig_by_cookie() -> &'static LruHashMap<u64, Endpoint> {
        &ORIG_BY_COOKIE
    }
    fn orig_by_peer() -> &'static LruHashMap<Endpoint, Endpoint> {
        &ORIG_BY_PEER
    }
    fn redirect(cfg: &Config, in_host_netns: bool) -> Option<Endpoint> {
        let to = if in_host_netns {
            cfg.redirect
        } else {
            cfg.pod_redirect
        };
        (!to.is_unset()).then_some(to)
    }
    fn client(ctx: &SockOpsContext) -> Endpoint {
        // local_ip4 is network order, local_port is already host order (unlike remote_port).
        Endpoint::new(u32::from_be(ctx.local_ip4()), ctx.local_port() as u16)
    }
    fn log_redirected(ctx: &SockAddrContext, dst: Endpoint, to: Endpoint, cookie: u64) {
        debug!(
            ctx,
            "redirected {:i}:{} to {:i}:{} (socket cookie {})",
            dst.ip,
            dst.port,
            to.ip,
            to.port,
            cookie
        );
    }
    fn log_no_tunnel(ctx: &SockAddrContext, dst: Endpoint) {
        debug!(
            ctx,
            "refused {:i}:{}: no tunnel to its node (EHOSTDOWN)", dst.ip, dst.port
        );
    }
    const NO_REDIRECT: &'static str = "no redirect address for the client's network namespace";
    const NOT_RECORDED: &'static str = "original destination not recorded";
    const NOT_STORED: &'static str = "original destination not stored by client address";
}

impl Family for V6 {
    type Endpoint = Endpoint6;
    fn edges() -> &'static HashMap<Endpoint6, u32> {
        &EDGES6
    }
    fn orig_by_cookie() -> &'static LruHashMap<u64, Endpoint6> {
        &ORIG6_BY_COOKIE
    }
    fn orig_by_peer() -> &'static LruHashMap<Endpoint6, Endpoint6> {
        &ORIG6_BY_PEER
    }
    fn redirect(cfg: &Config, in_host_netns: bool) -> Option<Endpoint6> {
        let to = if in_host_netns {
            cfg.redirect6
        } else {
            cfg.pod_redirect6
        };
        (!to.is_unset()).then_some(to)
    }
    fn client(ctx: &SockOpsContext) -> Endpoint6 {
        Endpoint6::new(local_ip6(ctx), ctx.local_port() as u16)
    }
    fn log_redirected(ctx: &SockAddrContext, dst: Endpoint6, to: Endpoint6, cookie: u64) {
        debug!(
            ctx,
            "redirected [{:i}]:{} to [{:i}]:{} (socket cookie {})",
            dst.octets(),
            dst.port,
            to.octets(),
            to.port,
            cookie
        );
    }
    fn log_no_tunnel(ctx: &SockAddrContext, dst: Endpoint6) {
        debug!(
            ctx,
            "refused [{:i}]:{}: no tunnel to its node (EHOSTDOWN)",
            dst.octets(),
            dst.port
        );
    }
    const NO_REDIRECT: &'static str = "no IPv6 redirect address for the client's network namespace";
    const NOT_RECORDED: &'static str = "original IPv6 destination not recorded";
    const NOT_STORED: &'static str = "original IPv6 destination not stored by client address";
}

/// What to do with a TCP connect to an edge target.
enum Target<E> {
    /// Leave it alone.
    Pass,
    /// Fail it: no replica holds the node's tunnel.
    NoTunnel,
    /// Send it here instead; its destination is recorded under the socket cookie.
    Redirect(E),
}

impl<E> Target<E> {
    /// Carries out the decision, rewriting the destination with `rewrite` for a redirect;
    /// the counter of the outcome.
    #[inline(always)]
    fn apply(self, rewrite: impl FnOnce(E)) -> Counter {
        match self {
            Target::Pass => Counter::Passed,
            Target::NoTunnel => Counter::NoTunnel,
            Target::Redirect(target) => {
                rewrite(target);
                Counter::Redirected
            }
        }
    }
}

/// What to do with a TCP connect to `dst`. A target without a tunnel is refused only
/// where it would have been redirected (a live cloud, a client outside the exempt cgroup,
/// a redirect listener for its netns), and only when `REFUSE`.
fn redirect_target<F: Family, const REFUSE: bool>(
    ctx: &SockAddrContext,
    dst: F::Endpoint,
) -> Result<Target<F::Endpoint>, Failed> {
    if !is_tcp(ctx) {
        return Ok(Target::Pass);
    }
    let Some(state) = F::edges().get_ptr(dst) else {
        return Ok(Target::Pass);
    };
    // SAFETY: a map value pointer from a lookup just made; the verifier checks the read.
    let state = unsafe { *state };
    let Some(cfg) = redirectable()? else {
        return Ok(Target::Pass);
    };
    let target = F::redirect(cfg, in_host_netns(ctx, cfg)).ok_or(Failed(F::NO_REDIRECT))?;
    if REFUSE && state == EdgeState::NoTunnel as u32 {
        if cfg.log_level >= LogLevel::Debug as u32 {
            F::log_no_tunnel(ctx, dst);
        }
        return Ok(Target::NoTunnel);
    }
    // SAFETY: a BPF helper that only reads the program context's state.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // Record before the caller rewrites: if the record fails the connect must stay
    // untouched, since tunnel-cloud could not route a connection it cannot attribute.
    F::orig_by_cookie()
        .insert(cookie, dst, 0)
        .map_err(|_| Failed(F::NOT_RECORDED))?;
    if cfg.log_level >= LogLevel::Debug as u32 {
        F::log_redirected(ctx, dst, target, cookie);
    }
    Ok(Target::Redirect(target))
}

#[sock_ops]
pub fn sockops_handoff(ctx: SockOpsContext) -> u32 {
    if ctx.family() == AF_INET || ctx.family() == AF_INET6 {
        match ctx.op() {
            BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
                let handed = if is_v6(&ctx) {
                    on_established::<V6>(&ctx)
                } else {
                    on_established::<V4>(&ctx)
                };
                if let Err(Failed(why)) = handed {
                    if log_enabled(LogLevel::Warn) {
                        warn!(&ctx, "redirected connection not handed over: {}", why);
                    }
                    count(Counter::Errors);
                }
            }
            BPF_SOCK_OPS_STATE_CB if is_v6(&ctx) => on_state_change::<V6>(&ctx),
            BPF_SOCK_OPS_STATE_CB => on_state_change::<V4>(&ctx),
            _ => {}
        }
    }
    // sock_ops return values are only read for a few ops we do not handle; 1 is "ok".
    1
}

/// Whether the connection is IPv6 proper (the `*6` maps). An AF_INET6 socket may carry a
/// v4-mapped connection instead (the IPv4 maps; local_ip4 is filled in for it); its
/// local address says which, since a mapped connection's source is mapped too.
#[inline(always)]
fn is_v6(ctx: &SockOpsContext) -> bool {
    ctx.family() == AF_INET6 && v4_mapped(local_ip6(ctx)).is_none()
}

/// `local_ip6` word by word: the verifier allows only 4-byte loads from it.
#[inline(always)]
fn local_ip6(ctx: &SockOpsContext) -> [u32; 4] {
    // SAFETY: `ops` is the kernel's sock_ops context of this call; the verifier checks
    // each field access (offset and size).
    unsafe {
        [
            (*ctx.ops).local_ip6[0],
            (*ctx.ops).local_ip6[1],
            (*ctx.ops).local_ip6[2],
            (*ctx.ops).local_ip6[3],
        ]
    }
}

#[inline(always)]
fn socket_cookie(ctx: &SockOpsContext) -> u64 {
    // SAFETY: a BPF helper that only reads the current task's or the program context's
    // state.
    unsafe { bpf_get_socket_cookie(ctx.ops as *mut c_void) }
}

fn on_established<F: Family>(ctx: &SockOpsContext) -> Result<(), Failed> {
    // Not redirected by connect4/6 (the common case): nothing to do.
    let Some(orig) = F::orig_by_cookie().get_ptr(socket_cookie(ctx)) else {
        return Ok(());
    };
    // SAFETY: a map value pointer from a lookup just made; the verifier checks the read.
    let orig = unsafe { *orig };
    F::orig_by_peer()
        .insert(F::client(ctx), orig, 0)
        .map_err(|_| Failed(F::NOT_STORED))?;
    // Ask for state-change callbacks on this socket only, so both entries can be dropped
    // when it closes instead of waiting for LRU eviction (and so a later connection that
    // reuses the same local port never sees a stale original destination).
    ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32)
        .map_err(|_| Failed("close callback not enabled"))
}

fn on_state_change<F: Family>(ctx: &SockOpsContext) {
    // args[1] is the new state.
    if ctx.arg(1) != BPF_TCP_CLOSE {
        return;
    }
    // Either entry may already be gone (taken by tunnel-cloud, or evicted): not an error.
    let _ = F::orig_by_cookie().remove(socket_cookie(ctx));
    let _ = F::orig_by_peer().remove(F::client(ctx));
}

#[cgroup_sock_addr(getpeername4)]
pub fn getpeername4(ctx: SockAddrContext) -> i32 {
    // SAFETY: a BPF helper that only reads the current task's or the program context's
    // state.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if let Some(orig) = ORIG_BY_COOKIE.get_ptr(cookie) {
        // SAFETY: a pointer to a map value from a lookup made in this run, valid while it
        // runs.
        let orig = unsafe { *orig };
        // SAFETY: `sock_addr` is the kernel's context of this call; the verifier checks
        // each field access (offset and size).
        unsafe {
            (*ctx.sock_addr).user_ip4 = orig.ip.to_be();
            (*ctx.sock_addr).user_port = u32::from(orig.port.to_be());
        }
    }
    // getpeername programs must return 1; they can only rewrite the address.
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn getpeername6(ctx: SockAddrContext) -> i32 {
    // SAFETY: a BPF helper that only reads the current task's or the program context's
    // state.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if let Some(orig) = ORIG6_BY_COOKIE.get_ptr(cookie) {
        // SAFETY: a pointer to a map value from a lookup made in this run, valid while it
        // runs.
        set_ip6(&ctx, unsafe { *orig });
    } else if let Some(orig) = ORIG_BY_COOKIE.get_ptr(cookie) {
        // SAFETY: a pointer to a map value from a lookup made in this run, valid while it
        // runs.
        set_v4_mapped(&ctx, unsafe { *orig });
    }
    ALLOW
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // Unreachable in a verified program (the verifier rejects any path to it), but
    // no_std needs a handler.
    loop {}
}

// No GPL-only helper is used (bpf_set_retval is not one either), so the kernel accepts the project's own license.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 11] = *b"Apache-2.0\0";
