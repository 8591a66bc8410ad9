//! The admin listener's log level (`PUT /debug/flags/v`, a body of up to 4 KiB):
//! `tunnel_user::ops::logging::filter_from_spec`.
//!
//! Properties: nothing panics (tracing-subscriber's parser did, see `filter_from_spec`)
//! or takes long (a field value compiled as a regular expression did: libFuzzer's
//! -timeout catches that); an accepted spec becomes its directives, trimmed, as a
//! filter that parses as it is; a glog number maps to a level.

use tracing_subscriber::EnvFilter;

/// Input: the request body, read as the admin listener does (lossy UTF-8).
pub fn check(data: &[u8]) {
    let spec = String::from_utf8_lossy(data);
    let Ok(filter) = tunnel_user::ops::logging::filter_from_spec(&spec) else {
        return;
    };
    if spec.trim().parse::<u32>().is_ok() {
        assert!(
            ["info", "debug", "trace"].contains(&filter.as_str()),
            "glog level {spec:?} became {filter:?}"
        );
    } else {
        let directives: Vec<&str> = spec
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .collect();
        assert_eq!(
            filter,
            directives.join(","),
            "the filter is not the spec's directives"
        );
    }
    assert!(
        EnvFilter::builder()
            .with_regex(false)
            .parse(&filter)
            .is_ok(),
        "accepted filter {filter:?} does not parse"
    );
}
