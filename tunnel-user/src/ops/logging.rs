//! Tracing set-up, with a filter that can be changed at runtime from the admin listener.

use std::sync::{LazyLock, OnceLock};

use tokio::sync::watch;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Registry, reload};

static FILTER: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();

/// Bumped on every filter change, for parts that keep their own copy of a log level
/// (the eBPF programs' `log_level`).
static FILTER_CHANGES: LazyLock<watch::Sender<u64>> = LazyLock::new(|| watch::Sender::new(0));

/// Wakes whenever the log filter changes at runtime.
pub(crate) fn filter_changes() -> watch::Receiver<u64> {
    FILTER_CHANGES.subscribe()
}

/// Installs the global subscriber. `RUST_LOG` overrides `default` (e.g. "info").
pub fn init(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let (layer, handle) = reload::Layer::new(filter);
    let fmt = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if tracing_subscriber::registry()
        .with(layer)
        .with(fmt)
        .try_init()
        .is_ok()
    {
        let _ = FILTER.set(handle);
    }
}

/// Translates what an operator sends into a filter: a glog verbosity number as
/// SuperEdge users send (`curl -X PUT .../debug/flags/v -d 8`), or a tracing filter
/// string (`info,tunnel_user::cloud=debug`).
pub fn filter_from_spec(spec: &str) -> Result<String, String> {
    let spec = spec.trim();
    if let Ok(v) = spec.parse::<u32>() {
        return Ok(match v {
            0..=2 => "info",
            3..=4 => "debug",
            _ => "trace",
        }
        .to_string());
    }
    // Every directive trimmed: tracing-subscriber 0.3 parses a directive with the
    // positions of its trimmed copy but slices the untrimmed one, and panics when white
    // space before a directive meets a multi-byte character (found by the admin_filter
    // fuzz target; fuzz/corpus/admin_filter/regress-space-before-multibyte).
    let directives: Vec<&str> = spec
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    // tracing-subscriber 0.3.23 never finds two literal field values equal (its
    // `ValueMatch` equality has no case for them), and with debug assertions on its
    // directive ordering then panics on two directives that differ only in level; one
    // such directive at a time is enough for `[conn{node=edge-1}]=debug`.
    if directives.iter().filter(|d| has_field_value(d)).count() > 1 {
        return Err(format!(
            "invalid filter `{spec}`: at most one directive may match a field value"
        ));
    }
    let spec = directives.join(",");
    parse_filter(&spec)
        .map(|_| spec.clone())
        .map_err(|e| format!("invalid filter `{spec}`: {e}"))
}

/// Whether a directive may match a field's value (`[span{field=value}]`): an `=`
/// between a `{` and the `}` after it, for any `{`. That counts more than
/// tracing-subscriber parses as a field value, never fewer: a target may hold braces
/// of its own, so the first `{` is not always where the fields begin (`a{b}[{f=v}]`;
/// found by the admin_filter fuzz target,
/// fuzz/corpus/admin_filter/regress-braces-in-the-target).
fn has_field_value(directive: &str) -> bool {
    directive.split('{').skip(1).any(|after| {
        after
            .split_once('}')
            .map_or(after, |(inside, _)| inside)
            .contains('=')
    })
}

/// A filter from the admin listener, which anyone who can reach it may send. Field
/// values match literally, not as regular expressions: compiling one is exponential
/// in its size (`[{f=.d<40 dots>}]` took over five minutes, on a runtime thread;
/// found by the admin_filter fuzz target, fuzz/corpus/admin_filter/regress-regex-blowup).
fn parse_filter(spec: &str) -> Result<EnvFilter, tracing_subscriber::filter::ParseError> {
    EnvFilter::builder().with_regex(false).parse(spec)
}

/// Applies a new filter; returns the filter now in force.
pub(crate) fn set_filter(spec: &str) -> Result<String, String> {
    let filter = filter_from_spec(spec)?;
    let handle = FILTER.get().ok_or("logging is not initialised")?;
    let parsed = parse_filter(&filter).map_err(|e| e.to_string())?;
    handle.reload(parsed).map_err(|e| e.to_string())?;
    FILTER_CHANGES.send_modify(|generation| *generation += 1);
    tracing::info!(%filter, "log filter changed");
    Ok(filter)
}

pub(crate) fn current_filter() -> String {
    FILTER
        .get()
        .and_then(|h| h.with_current(|f| f.to_string()).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glog_levels_and_filter_strings() {
        assert_eq!(filter_from_spec("8").unwrap(), "trace");
        assert_eq!(filter_from_spec(" 2\n").unwrap(), "info");
        assert_eq!(filter_from_spec("4").unwrap(), "debug");
        assert_eq!(
            filter_from_spec("info,tunnel_user=debug").unwrap(),
            "info,tunnel_user=debug"
        );
        assert!(filter_from_spec("info,[[[").is_err());
    }

    #[test]
    fn white_space_around_directives_is_dropped() {
        assert_eq!(
            filter_from_spec("info, tunnel_user=debug ,").unwrap(),
            "info,tunnel_user=debug"
        );
        // EnvFilter::try_new("info, éé=debug") panics (tracing-subscriber 0.3.23 slices
        // inside the second 'é'); trimmed first, the directive parses.
        assert_eq!(filter_from_spec("info, éé=debug").unwrap(), "info,éé=debug");
    }

    #[test]
    fn one_field_value_directive_at_most() {
        assert!(filter_from_spec("info,[conn{node=edge-1}]=debug").is_ok());
        assert!(filter_from_spec("[conn{node}]=debug,[conn{node}]=info").is_ok());
        // Two of them used to trip a debug assertion inside tracing-subscriber.
        let e = filter_from_spec("[{f=x}],[{f=x}]=info").expect_err("two field values");
        assert!(e.contains("at most one"), "{e}");
        // The target holds braces before the span's fields begin.
        let e = filter_from_spec("a{b}T[{f=x}]=4,a{b}T[{f=x}]=4").expect_err("two in a target");
        assert!(e.contains("at most one"), "{e}");
    }

    #[test]
    fn field_values_are_not_regular_expressions() {
        // As a regular expression this took over five minutes to compile.
        let spec = format!("info,[{{f=.d{}<*}}]=debug", ".".repeat(40));
        let started = std::time::Instant::now();
        assert_eq!(filter_from_spec(&spec).unwrap(), spec);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "took {:?}",
            started.elapsed()
        );
    }
}
