//! Results: every sample kept, medians and spread shown, ratios against direct, the
//! issue's targets checked, a table on stdout and the same in JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

pub const DIRECT: &str = "direct";
pub const TUNNEL: &str = "tunnel";
pub const RATHOLE: &str = "rathole";
pub const RATHOLE_TLS: &str = "rathole_tls";
/// The tunnel's HTTP CONNECT entry on a unix socket, through the bench's CONNECT front.
pub const TUNNEL_CONNECT: &str = "tunnel_connect";
/// Konnectivity (proxy-server + proxy-agent), through the same front.
pub const KONNECTIVITY: &str = "konnectivity";

/// How far ahead of Konnectivity the tunnel is to be on every figure (issue 25).
const KONNECTIVITY_FACTOR: f64 = 1.5;

#[derive(Serialize, Clone, Debug)]
pub struct Metric {
    pub key: String,
    pub name: String,
    pub unit: String,
    pub higher_is_better: bool,
    /// Path -> samples, in the order measured.
    pub samples: BTreeMap<String, Vec<f64>>,
    pub note: Option<String>,
    /// Per path: median, spread (half the range over the median) and ratio to direct.
    pub summary: BTreeMap<String, Summary>,
}

#[derive(Serialize, Clone, Debug)]
pub struct Summary {
    pub median: Option<f64>,
    pub spread: Option<f64>,
    pub ratio_to_direct: Option<f64>,
}

impl Metric {
    pub fn median(&self, path: &str) -> Option<f64> {
        self.samples.get(path).and_then(|v| median(v))
    }

    /// Half the range as a fraction of the median.
    pub fn spread(&self, path: &str) -> Option<f64> {
        let v = self.samples.get(path)?;
        let m = median(v)?;
        let (lo, hi) = v
            .iter()
            .filter(|x| x.is_finite())
            .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        (v.len() > 1 && m != 0.0).then(|| (hi - lo) / 2.0 / m.abs())
    }

    /// The median of `a` over the median of `b`; infinite when only `b` is zero (a
    /// stalled neighbour that moved nothing).
    pub fn versus(&self, a: &str, b: &str) -> Option<f64> {
        let (a, b) = (self.median(a)?, self.median(b)?);
        match (a == 0.0, b == 0.0) {
            (_, false) => Some(a / b),
            (false, true) => Some(f64::INFINITY),
            (true, true) => None,
        }
    }

    pub fn ratio(&self, path: &str) -> Option<f64> {
        let d = self.median(DIRECT)?;
        (d != 0.0)
            .then(|| self.median(path).map(|p| p / d))
            .flatten()
    }
}

pub fn median(v: &[f64]) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    })
}

pub fn percentile(v: &mut [f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(idx).copied()
}

#[derive(Default, Serialize)]
pub struct Results {
    pub metrics: Vec<Metric>,
    pub errors: Vec<String>,
    pub notes: Vec<String>,
    pub targets: Vec<TargetCheck>,
    pub settings: BTreeMap<String, String>,
}

#[derive(Serialize, Clone, Debug)]
pub struct TargetCheck {
    pub target: String,
    pub value: String,
    pub met: Option<bool>,
}

impl Results {
    /// The metric `key`, created on first use.
    pub fn metric(
        &mut self,
        key: &str,
        name: &str,
        unit: &str,
        higher_is_better: bool,
    ) -> &mut Metric {
        if let Some(i) = self.metrics.iter().position(|m| m.key == key) {
            return &mut self.metrics[i];
        }
        self.metrics.push(Metric {
            key: key.into(),
            name: name.into(),
            unit: unit.into(),
            higher_is_better,
            samples: BTreeMap::new(),
            note: None,
            summary: BTreeMap::new(),
        });
        self.metrics.last_mut().expect("just pushed")
    }

    pub fn add(
        &mut self,
        key: &str,
        name: &str,
        unit: &str,
        higher_is_better: bool,
        path: &str,
        value: f64,
    ) {
        self.metric(key, name, unit, higher_is_better)
            .samples
            .entry(path.into())
            .or_default()
            .push(value);
    }

    pub fn get(&self, key: &str) -> Option<&Metric> {
        self.metrics.iter().find(|m| m.key == key)
    }

    fn has_path(&self, path: &str) -> bool {
        self.metrics.iter().any(|m| m.samples.contains_key(path))
    }

    /// Columns: the medians of each path measured, then ratios to direct, then the
    /// tunnel's CONNECT over Konnectivity's. A path no figure has is left out.
    pub fn table(&self) -> String {
        let values: Vec<(&str, &str)> = [
            (DIRECT, "direct"),
            (TUNNEL, "tunnel"),
            (RATHOLE, "rathole"),
            (RATHOLE_TLS, "rathole TLS"),
            (TUNNEL_CONNECT, "tunnel CONNECT"),
            (KONNECTIVITY, "Konnectivity"),
        ]
        .into_iter()
        .filter(|(p, _)| matches!(*p, DIRECT | TUNNEL | RATHOLE) || self.has_path(p))
        .collect();
        let ratios: Vec<(&str, &str)> = [
            (TUNNEL, "tunnel/direct"),
            (RATHOLE, "rathole/direct"),
            (RATHOLE_TLS, "rTLS/direct"),
            (TUNNEL_CONNECT, "tCONNECT/direct"),
            (KONNECTIVITY, "Konn/direct"),
        ]
        .into_iter()
        .filter(|(p, _)| matches!(*p, TUNNEL | RATHOLE) || self.has_path(p))
        .collect();
        let versus = self.has_path(TUNNEL_CONNECT) && self.has_path(KONNECTIVITY);
        let mut head = vec!["metric", "unit"];
        head.extend(values.iter().map(|(_, h)| *h));
        head.extend(ratios.iter().map(|(_, h)| *h));
        if versus {
            head.push("tCONNECT/Konn");
        }
        let mut rows: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
        for m in &self.metrics {
            let cell = |path: &str| match (m.median(path), m.spread(path)) {
                (Some(v), Some(s)) => format!("{} ±{:.0}%", fmt_num(v), s * 100.0),
                (Some(v), None) => fmt_num(v),
                _ => "-".into(),
            };
            let ratio = |r: Option<f64>| match r {
                Some(r) if r.is_infinite() => "inf".into(),
                Some(r) => format!("{r:.2}x"),
                None => "-".into(),
            };
            let mut row = vec![m.name.clone(), m.unit.clone()];
            row.extend(values.iter().map(|(p, _)| cell(p)));
            row.extend(ratios.iter().map(|(p, _)| ratio(m.ratio(p))));
            if versus {
                row.push(ratio(m.versus(TUNNEL_CONNECT, KONNECTIVITY)));
            }
            rows.push(row);
        }
        let widths: Vec<usize> = (0..rows[0].len())
            .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
            .collect();
        let mut out = String::new();
        for (i, row) in rows.iter().enumerate() {
            let cells: Vec<String> = row
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            let _ = writeln!(out, "| {} |", cells.join(" | "));
            if i == 0 {
                let _ = writeln!(
                    out,
                    "|{}|",
                    widths
                        .iter()
                        .map(|w| "-".repeat(w + 2))
                        .collect::<Vec<_>>()
                        .join("|")
                );
            }
        }
        out
    }

    /// The targets, against this run's medians; fills each metric's summary.
    pub fn check_targets(&mut self) {
        for m in &mut self.metrics {
            let paths: Vec<String> = m.samples.keys().cloned().collect();
            for p in paths {
                let summary = Summary {
                    median: m.median(&p),
                    spread: m.spread(&p),
                    ratio_to_direct: m.ratio(&p),
                };
                m.summary.insert(p, summary);
            }
        }
        let mut checks = Vec::new();
        let ratio_check =
            |r: &Results, key: &str, what: &str, bound: f64, at_least: bool| -> TargetCheck {
                let v = r.get(key).and_then(|m| m.ratio(TUNNEL));
                TargetCheck {
                    target: format!(
                        "{what} {} {bound}x direct",
                        if at_least { ">=" } else { "<=" }
                    ),
                    value: v
                        .map(|v| format!("{v:.2}x"))
                        .unwrap_or_else(|| "not measured".into()),
                    met: v.map(|v| if at_least { v >= bound } else { v <= bound }),
                }
            };
        checks.push(ratio_check(
            self,
            "bulk_1_up",
            "single-stream bulk (cloud->edge)",
            0.35,
            true,
        ));
        checks.push(ratio_check(
            self,
            "bulk_1_down",
            "single-stream bulk (edge->cloud)",
            0.35,
            true,
        ));
        checks.push(ratio_check(
            self,
            "newconn_p50",
            "new-connection p50",
            2.5,
            false,
        ));
        checks.push(ratio_check(
            self,
            "two_write_c50_rps",
            "two-write responses req/s (50 conns)",
            0.5,
            true,
        ));
        let abs = |r: &Results, key: &str, what: &str, bound: f64| -> TargetCheck {
            let v = r.get(key).and_then(|m| m.median(TUNNEL));
            let unit = r.get(key).map(|m| m.unit.clone()).unwrap_or_default();
            TargetCheck {
                target: format!("{what} <= {bound} {unit}"),
                value: v
                    .map(|v| format!("{} {unit}", fmt_num(v)))
                    .unwrap_or_else(|| "not measured".into()),
                met: v.map(|v| v <= bound),
            }
        };
        checks.push(abs(
            self,
            "idle_total_kib",
            "RSS per idle proxied connection, cloud + edge",
            16.0,
        ));
        let scale_key = self
            .metrics
            .iter()
            .filter(|m| m.key.starts_with("scale_") && m.key.ends_with("_rss_kib"))
            .max_by_key(|m| {
                m.key
                    .trim_start_matches("scale_")
                    .trim_end_matches("_rss_kib")
                    .parse::<usize>()
                    .unwrap_or(0)
            })
            .map(|m| (m.key.clone(), m.name.clone()));
        match scale_key {
            Some((key, name)) => checks.push(abs(
                self,
                &key,
                &format!("{name} (target is at 10k edges)"),
                32.0,
            )),
            None => checks.push(TargetCheck {
                target: "cloud RSS per idle edge <= 32 KiB".into(),
                value: "not measured".into(),
                met: None,
            }),
        }
        // Efficiency: CPU of the relay's two processes per unit of work, against
        // rathole's two (plain TCP).
        let cpu_keys: Vec<(String, String, String)> = self
            .metrics
            .iter()
            .filter(|m| m.key.ends_with("_cpu"))
            .map(|m| (m.key.clone(), m.name.clone(), m.unit.clone()))
            .collect();
        for (key, name, unit) in cpu_keys {
            let m = self.get(&key);
            let (t, r) = (
                m.and_then(|m| m.median(TUNNEL)),
                m.and_then(|m| m.median(RATHOLE)),
            );
            checks.push(TargetCheck {
                target: format!("{name}, cloud + edge <= rathole's"),
                value: match (t, r) {
                    (Some(t), Some(r)) => {
                        format!("{} vs {} {unit} ({:.2}x)", fmt_num(t), fmt_num(r), t / r)
                    }
                    (Some(t), None) => format!("{} {unit}, rathole not measured", fmt_num(t)),
                    _ => "not measured".into(),
                },
                met: t.zip(r).map(|(t, r)| t <= r),
            });
        }
        // Round trips to a new connection's first response byte (issue 13, target 5).
        // A tenth of a round trip is scheduling noise, not a round trip.
        let rtt = |r: &Results, key: &str, path: &str| r.get(key).and_then(|m| m.median(path));
        let forward = rtt(self, "rtt_forward", TUNNEL);
        let direct = rtt(self, "rtt_forward", DIRECT);
        if forward.is_some() || direct.is_some() {
            checks.push(TargetCheck {
                target: "forwarded new connection: no more round trips than direct".into(),
                value: match (forward, direct) {
                    (Some(f), Some(d)) => format!("{f:.2} vs {d:.2} RTT"),
                    _ => "not measured".into(),
                },
                met: forward.zip(direct).map(|(f, d)| f <= d + 0.1),
            });
            let connect = rtt(self, "rtt_connect", TUNNEL);
            checks.push(TargetCheck {
                target: "HTTP CONNECT: at most one round trip (its 200) more than a forward".into(),
                value: match (connect, forward) {
                    (Some(c), Some(f)) => format!("{c:.2} vs {f:.2} RTT"),
                    _ => "not measured".into(),
                },
                met: connect.zip(forward).map(|(c, f)| c <= f + 1.1),
            });
        }
        // Idle footprint and start-up (issue 13).
        let (rss_bound_mib, first_byte_bound_ms) = (10.0, 400.0);
        let tunnel = |key: &str| self.get(key).and_then(|m| m.median(TUNNEL));
        let startup = (
            tunnel("startup_cloud_rss"),
            tunnel("startup_edge_rss"),
            tunnel("startup_first_byte"),
        );
        checks.push(TargetCheck {
            target: format!(
                "idle footprint: cloud and edge each <= {rss_bound_mib} MiB RSS, first proxied byte <= {first_byte_bound_ms} ms after start"
            ),
            value: match startup {
                (Some(cloud), Some(edge), Some(first)) => format!(
                    "cloud {} MiB, edge {} MiB, first byte {} ms",
                    fmt_num(cloud),
                    fmt_num(edge),
                    fmt_num(first)
                ),
                _ => "not measured".into(),
            },
            met: match startup {
                (Some(cloud), Some(edge), Some(first)) => Some(
                    cloud <= rss_bound_mib
                        && edge <= rss_bound_mib
                        && first <= first_byte_bound_ms,
                ),
                _ => None,
            },
        });
        let iso = self.get("isolation_ratio").and_then(|m| m.median(TUNNEL));
        checks.push(TargetCheck {
            target: "neighbour throughput while one stream is stalled >= 90% of unstalled".into(),
            value: iso
                .map(|v| format!("{:.0}%", v * 100.0))
                .unwrap_or_else(|| "not measured".into()),
            met: iso.map(|v| v >= 0.9),
        });
        // First target: ahead of rathole (plain TCP) on every metric both measured.
        let mut behind = Vec::new();
        let mut compared = 0;
        for m in &self.metrics {
            if let (Some(t), Some(r)) = (m.median(TUNNEL), m.median(RATHOLE)) {
                compared += 1;
                // Round trips are counted, not timed: a tenth of one is scheduling noise.
                let tolerance = if m.unit == "RTT" { 0.1 } else { 0.0 };
                let ahead = if m.higher_is_better {
                    t >= r
                } else {
                    t <= r + tolerance
                };
                if !ahead {
                    behind.push(format!("{} ({} vs {})", m.name, fmt_num(t), fmt_num(r)));
                }
            }
        }
        // Issue 25: ahead of Konnectivity by KONNECTIVITY_FACTOR on every metric both
        // measure, the tunnel's CONNECT entry against Konnectivity's; where the tunnel
        // has no CONNECT figure (start-up: the same processes), the tunnel's own.
        if self.has_path(KONNECTIVITY) {
            let mut behind = Vec::new();
            let mut compared = 0;
            for m in self.metrics.iter().filter(|m| m.key != "idle_held") {
                let t = m.median(TUNNEL_CONNECT).or_else(|| m.median(TUNNEL));
                if let (Some(t), Some(k)) = (t, m.median(KONNECTIVITY)) {
                    compared += 1;
                    let ahead = if m.higher_is_better {
                        t >= KONNECTIVITY_FACTOR * k
                    } else {
                        KONNECTIVITY_FACTOR * t <= k
                    };
                    if !ahead {
                        behind.push(format!("{} ({} vs {})", m.name, fmt_num(t), fmt_num(k)));
                    }
                }
            }
            checks.push(TargetCheck {
                target: format!(
                    "ahead of Konnectivity by >= {KONNECTIVITY_FACTOR}x on every metric, tunnel CONNECT vs Konnectivity ({compared} compared)"
                ),
                value: if behind.is_empty() {
                    "ahead on all".into()
                } else {
                    format!("not {KONNECTIVITY_FACTOR}x ahead on: {}", behind.join("; "))
                },
                met: (compared > 0).then_some(behind.is_empty()),
            });
        }
        checks.insert(
            0,
            TargetCheck {
                target: format!("ahead of rathole on every metric ({compared} compared)"),
                value: if behind.is_empty() {
                    "ahead on all".into()
                } else {
                    format!("behind on: {}", behind.join("; "))
                },
                met: (compared > 0).then_some(behind.is_empty()),
            },
        );
        // The fleet's targets, checked as each fleet ran.
        checks.append(&mut self.targets);
        self.targets = checks;
    }

    pub fn targets_text(&self) -> String {
        let mut out = String::new();
        for c in &self.targets {
            let mark = match c.met {
                Some(true) => "MET   ",
                Some(false) => "MISSED",
                None => "n/a   ",
            };
            let _ = writeln!(out, "  {mark} {}: {}", c.target, c.value);
        }
        out
    }
}

pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_spread_ratio() {
        let mut r = Results::default();
        for v in [1.0, 3.0, 2.0] {
            r.add("k", "k", "u", true, DIRECT, v);
        }
        for v in [1.0, 0.5] {
            r.add("k", "k", "u", true, TUNNEL, v);
        }
        let m = r.get("k").unwrap();
        assert_eq!(m.median(DIRECT), Some(2.0));
        assert_eq!(m.median(TUNNEL), Some(0.75));
        assert_eq!(m.spread(DIRECT), Some(0.5));
        assert_eq!(m.ratio(TUNNEL), Some(0.375));
        assert!(r.table().contains("0.38x"));
    }

    #[test]
    fn rathole_comparison_respects_direction() {
        let mut r = Results::default();
        r.add("lat", "latency", "us", false, TUNNEL, 10.0);
        r.add("lat", "latency", "us", false, RATHOLE, 20.0);
        r.add("rps", "rate", "1/s", true, TUNNEL, 10.0);
        r.add("rps", "rate", "1/s", true, RATHOLE, 20.0);
        r.check_targets();
        let first = &r.targets[0];
        assert_eq!(first.met, Some(false));
        assert!(
            first.value.contains("rate") && !first.value.contains("latency"),
            "{}",
            first.value
        );
    }

    #[test]
    fn konnectivity_comparison_wants_the_factor_and_falls_back_to_the_tunnel() {
        let mut r = Results::default();
        r.add("rps", "rate", "1/s", true, TUNNEL_CONNECT, 30.0);
        r.add("rps", "rate", "1/s", true, KONNECTIVITY, 20.0);
        r.add("lat", "latency", "us", false, TUNNEL_CONNECT, 10.0);
        r.add("lat", "latency", "us", false, KONNECTIVITY, 15.0);
        r.add("rss", "start-up rss", "MiB", false, TUNNEL, 10.0);
        r.add("rss", "start-up rss", "MiB", false, KONNECTIVITY, 14.0);
        r.check_targets();
        let check = r
            .targets
            .iter()
            .find(|c| c.target.starts_with("ahead of Konnectivity"))
            .unwrap();
        assert!(check.target.contains("3 compared"), "{}", check.target);
        assert_eq!(check.met, Some(false));
        assert!(
            check.value.contains("start-up rss") && !check.value.contains("rate"),
            "{}",
            check.value
        );
        let table = r.table();
        assert!(
            table.contains("tCONNECT/Konn") && table.contains("1.50x"),
            "{table}"
        );
        let mut none = Results::default();
        none.add("rps", "rate", "1/s", true, TUNNEL, 30.0);
        none.check_targets();
        assert!(!none.table().contains("Konnectivity"));
        assert!(
            !none
                .targets
                .iter()
                .any(|c| c.target.contains("Konnectivity"))
        );
    }

    #[test]
    fn startup_target_needs_all_three_figures_in_bounds() {
        let check = |cloud: f64, edge: f64, first: f64| {
            let mut r = Results::default();
            r.add("startup_cloud_rss", "c", "MiB", false, TUNNEL, cloud);
            r.add("startup_edge_rss", "e", "MiB", false, TUNNEL, edge);
            r.add("startup_first_byte", "f", "ms", false, TUNNEL, first);
            r.check_targets();
            r.targets
                .into_iter()
                .find(|c| c.target.starts_with("idle footprint"))
                .unwrap()
        };
        let met = check(8.0, 9.5, 120.0);
        assert_eq!(met.met, Some(true));
        assert_eq!(
            met.value,
            "cloud 8.00 MiB, edge 9.50 MiB, first byte 120.0 ms"
        );
        assert_eq!(check(8.0, 10.5, 120.0).met, Some(false));
        assert_eq!(check(8.0, 9.5, 401.0).met, Some(false));
        let mut unmeasured = Results::default();
        unmeasured.check_targets();
        assert!(
            unmeasured
                .targets
                .iter()
                .any(|c| c.target.starts_with("idle footprint") && c.met.is_none())
        );
    }

    #[test]
    fn percentile_picks_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.5), Some(51.0));
        assert_eq!(percentile(&mut v, 0.99), Some(99.0));
    }
}
