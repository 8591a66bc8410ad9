//! The one-screen description of a configuration: printed by `tunnel check` and logged
//! at start, so what an operator checks is what runs.

use std::fmt::Write;

use super::{CloudConfig, EdgeConfig, OptimisticOk};

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref()
        .map(|v| v.to_string())
        .unwrap_or_else(|| "off".into())
}

impl CloudConfig {
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let t = &self.tunnel;
        let auth = match (&t.token_file, &t.client_ca) {
            (Some(f), Some(ca)) => format!(
                "token file {} or client certificate (CA {})",
                f.display(),
                ca.display()
            ),
            (Some(f), None) => format!("token file {}", f.display()),
            (None, Some(ca)) => format!("client certificate (CA {})", ca.display()),
            (None, None) => "none".into(),
        };
        let cert = match &t.cert {
            Some(cert) if !self.csr.serving => cert.display().to_string(),
            _ => "self-issued in memory, csr.serving".into(),
        };
        match t.listen {
            Some(listen) => {
                let _ = writeln!(s, "tunnel cloud");
                let _ = writeln!(s, "  edges connect to   {listen} (TLS cert {cert})");
                let _ = writeln!(s, "  edge auth          {auth}");
            }
            None => {
                let _ = writeln!(s, "tunnel cloud, role relay: no edge session held here");
                let _ = writeln!(s, "  client certificate {cert}");
            }
        }
        let _ = writeln!(
            s,
            "  node table         {} node(s) from the config",
            self.nodes.len()
        );
        for f in &self.forwards {
            let node = f.node.as_deref().unwrap_or("<first connected edge>");
            let _ = writeln!(
                s,
                "  forward            {} -> {node} {}",
                f.listen, f.target
            );
        }
        for h in &self.https {
            let _ = writeln!(
                s,
                "  https              {} -> <node from host name> {} (TLS)",
                h.listen, h.target
            );
        }
        for (name, targets) in &self.reverse.allow {
            let _ = writeln!(s, "  edge-to-cloud      {name} may reach {targets:?}");
        }
        let _ = writeln!(
            s,
            "  http connect       tcp {}, unix {}{}",
            opt(&self.connect.listen),
            opt(&self.connect.unix.as_ref().map(|p| p.display())),
            match self.connect.optimistic_ok {
                OptimisticOk::Never => "",
                OptimisticOk::Recent => {
                    " (optimistic_ok recent: 200 before the dial result for a target reached in the last minute)"
                }
                OptimisticOk::Always => " (optimistic_ok always: 200 before the dial result)",
            }
        );
        let r = &self.redirect;
        if r.enabled {
            let cgroup = r
                .cgroup
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "detected cgroup v2 root".into());
            let (pods, pods6) = match r.pod_port {
                Some(port) => {
                    let node = format!("this node's address ({}):{port}", crate::addr::NODE_IPS);
                    (node.clone(), node)
                }
                None => (opt(&r.pod_listen), opt(&r.pod_listen6)),
            };
            let _ = writeln!(
                s,
                "  eBPF redirect      on {cgroup}, ports {:?} -> {} (pods -> {pods}); IPv6 -> {} (pods -> {pods6})",
                r.ports,
                r.listen,
                r.listen6.unwrap_or_else(|| r.default_listen6()),
            );
        } else {
            let _ = writeln!(s, "  eBPF redirect      off");
        }
        let _ = writeln!(s, "  admin              {}", opt(&self.admin.listen));
        s
    }
}

impl EdgeConfig {
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let c = &self.cloud;
        let auth = match (&c.token, &c.token_file, &c.cert) {
            (_, _, Some(cert)) => format!("client certificate {}", cert.display()),
            (Some(_), _, None) => "token (inline)".into(),
            (None, Some(f), None) => format!("token file {}", f.display()),
            (None, None, None) => "none".into(),
        };
        let _ = writeln!(s, "tunnel edge");
        let _ = writeln!(s, "  {:<18} {}", self.identity.as_str(), self.node());
        let _ = writeln!(
            s,
            "  cloud              {} (server name {}, CA {})",
            c.address,
            c.server_name,
            c.ca.display()
        );
        let _ = writeln!(s, "  auth               {auth}");
        let a = &self.allow;
        if a.any {
            let _ = writeln!(
                s,
                "  allowlist          none: any target the cloud names (SuperEdge behaviour)"
            );
        } else {
            let addrs = if a.node_addresses.is_empty() {
                "from NODE_IPS, else detected at start".to_string()
            } else {
                format!("{:?}", a.node_addresses)
            };
            let _ = writeln!(
                s,
                "  allowlist          {:?}; node addresses {addrs} on ports {:?}",
                a.targets, a.ports
            );
        }
        for f in &self.reverse.forwards {
            let _ = writeln!(s, "  reverse forward    {} -> cloud {}", f.listen, f.target);
        }
        if let Some(p) = &self.proxy {
            let _ = writeln!(
                s,
                "  http proxy         {} (CONNECT to cloud targets)",
                p.listen
            );
        }
        if !self.hooks.pre_start.is_empty() || !self.hooks.post_start.is_empty() {
            let h = &self.hooks;
            let _ = writeln!(
                s,
                "  hooks              pre_start {:?}, post_start {:?}, failure {:?}, timeout {:?}",
                h.pre_start, h.post_start, h.failure, h.timeout
            );
        }
        let _ = writeln!(s, "  admin              {}", opt(&self.admin.listen));
        s
    }
}
