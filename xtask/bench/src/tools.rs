//! The load tools from Debian: iperf3 for bulk throughput, wrk for HTTP.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::procs::run_bounded;

/// What one iperf3 run moved.
pub struct Iperf {
    /// Received, Gbit/s.
    pub gbps: f64,
    /// Bytes received.
    pub bytes: f64,
}

/// iperf3 throughput (received side). `reverse`: the server sends. The server
/// may still be finishing the previous test behind a relay that closes late ("busy"):
/// that is retried a few times.
pub fn iperf3(addr: SocketAddr, secs: u64, streams: u32, reverse: bool) -> Result<Iperf> {
    let mut tries = 0;
    loop {
        match iperf3_once(addr, secs, streams, reverse) {
            Err(e) if tries < 4 && e.to_string().contains("busy") => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(500 * tries));
            }
            r => return r,
        }
    }
}

fn iperf3_once(addr: SocketAddr, secs: u64, streams: u32, reverse: bool) -> Result<Iperf> {
    let mut cmd = Command::new("iperf3");
    cmd.args(["-c", &addr.ip().to_string(), "-p", &addr.port().to_string()])
        .args([
            "-t",
            &secs.to_string(),
            "-P",
            &streams.to_string(),
            "-J",
            "--connect-timeout",
            "5000",
        ]);
    if reverse {
        cmd.arg("-R");
    }
    let out = run_bounded(&mut cmd, Duration::from_secs(secs + 20))?;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "iperf3 output is not JSON: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if let Some(err) = json.get("error").and_then(|e| e.as_str()) {
        bail!("iperf3 to {addr}: {err}");
    }
    let bps = json["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3: no end.sum_received.bits_per_second")?;
    let bytes = json["end"]["sum_received"]["bytes"]
        .as_f64()
        .context("iperf3: no end.sum_received.bytes")?;
    if bps <= 0.0 || bytes <= 0.0 {
        bail!("iperf3 to {addr}: nothing received");
    }
    Ok(Iperf {
        gbps: bps / 1e9,
        bytes,
    })
}

pub struct WrkResult {
    pub rps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Requests completed in the run (wrk's "N requests in").
    pub requests: f64,
}

/// wrk with one thread: requests/s and latency percentiles.
pub fn wrk(addr: SocketAddr, path: &str, conns: u32, secs: u64) -> Result<WrkResult> {
    let url = format!("http://{addr}{path}");
    let out = run_bounded(
        Command::new("wrk").args([
            "-t1",
            "-c",
            &conns.to_string(),
            "-d",
            &format!("{secs}s"),
            "--timeout",
            "5s",
            "--latency",
            &url,
        ]),
        Duration::from_secs(secs + 20),
    )?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "wrk {url}: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse_wrk(&text).with_context(|| format!("wrk {url} output:\n{text}"))
}

fn parse_wrk(text: &str) -> Result<WrkResult> {
    let mut rps = None;
    let (mut p50, mut p99, mut requests) = (None, None, None);
    for line in text.lines() {
        let t = line.trim();
        if let Some((n, _)) = t.split_once(" requests in ") {
            requests = n.trim().parse::<f64>().ok();
        } else if let Some(v) = t.strip_prefix("Requests/sec:") {
            rps = v.trim().parse::<f64>().ok();
        } else if let Some(v) = t.strip_prefix("50%") {
            p50 = parse_duration_us(v.trim());
        } else if let Some(v) = t.strip_prefix("99%") {
            p99 = parse_duration_us(v.trim());
        } else if t.starts_with("Non-2xx or 3xx responses") {
            bail!("wrk saw error responses: {t}");
        }
    }
    let rps = rps.context("no Requests/sec")?;
    if rps <= 0.0 {
        bail!("no requests completed");
    }
    Ok(WrkResult {
        rps,
        p50_us: p50.context("no 50% line")?,
        p99_us: p99.context("no 99% line")?,
        requests: requests.context("no \"requests in\" line")?,
    })
}

/// wrk's "123.45us", "1.23ms", "2.00s", "1.5m".
fn parse_duration_us(v: &str) -> Option<f64> {
    let split = v.find(|c: char| c.is_ascii_alphabetic())?;
    let (num, unit) = v.split_at(split);
    let n: f64 = num.parse().ok()?;
    let scale = match unit {
        "us" => 1.0,
        "ms" => 1e3,
        "s" => 1e6,
        "m" => 60e6,
        _ => return None,
    };
    Some(n * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_wrk_output() {
        let out = "Running 1s test @ http://127.0.0.1:1/\n  1 threads and 1 connections\n  Latency Distribution\n     50%   41.00us\n     75%   45.00us\n     90%   50.00us\n     99%    1.20ms\n  3000 requests in 1.00s, 1.00MB read\nRequests/sec:   2999.50\nTransfer/sec:      1.00MB\n";
        let r = parse_wrk(out).unwrap();
        assert_eq!(r.rps, 2999.5);
        assert_eq!(r.p50_us, 41.0);
        assert_eq!(r.p99_us, 1200.0);
        assert_eq!(r.requests, 3000.0);
        assert!(parse_wrk("Requests/sec: 0.00\n").is_err());
    }
}
