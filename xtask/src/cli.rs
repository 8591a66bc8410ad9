//! xtask's command line. Parsed with lexopt, which builds in about a second: with clap's
//! derive (syn, clap_builder) xtask took as long to build on a fresh clone as the eBPF
//! object that `cargo xtask build-ebpf` is run for.

use std::ffi::OsString;

use lexopt::prelude::*;

use crate::fuzz::FuzzArgs;

pub const USAGE: &str = "\
Developer commands for the tunnel workspace.

Usage: cargo xtask <COMMAND> [OPTIONS]

Commands:
  build-ebpf     Build the eBPF object `tunnel` embeds (tunnel-ebpf, bpfel-unknown-none,
                 nightly) in the release profile, as tunnel-user/build.rs builds it, so a
                 later `cargo build` finds it built. Prints the object's path.
  bench          Benchmark the tunnel against a direct connection, rathole and
                 Konnectivity, on loopback: the crate xtask/bench, built and run in
                 release. Its options: `cargo xtask bench --help`.
  bench-connect  connect() latency from a child cgroup with vs. without the intercept
                 programs (root; runs the tunnel-user example `bench_connect`).
      --rounds N       interleaved rounds [default: 10]
      --connects N     connect() calls per round and side [default: 2000]
  fuzz           Run the fuzz targets (fuzz/) for a bounded time each.
      --smoke          CI mode: 12 s per target, a throw-away working corpus, libFuzzer's
                       output shown only on failure
      --target NAME    fuzz only this target (repeat for several) [default: all]
      --seconds N      seconds per target [default: 12 with --smoke, 300 without]
      --asan           build with AddressSanitizer (worth a run after a change to
                       `unsafe` code or to a C dependency)
  soak           The long versions of the leak, load and flapping tests (TUNNEL_SOAK=1):
                 100k short connections, 1,000 new connections/s for 60 s, 1,000 edge
                 reconnects. The test suite runs the short versions. About 15 minutes.
  image          The container image of `tunnel` (static musl binary, FROM scratch) as
                 tunnel:<version> in the local podman/buildah store and
                 target/image/tunnel-<version>.oci.tar. No registry is needed.
      --prometheus     instead, the image of deploy/monitoring/'s Prometheus: Debian's
                       `prometheus` (scripts/setup.sh installs it) and the libraries it
                       loads, FROM scratch, as tunnel-prometheus:<version> and
                       target/image/tunnel-prometheus-<version>.oci.tar
  shipped-binary The static musl `tunnel` the image holds (unstripped), built as `image`
                 builds it, with the build paths mapped to fixed names so the build is
                 the same in any directory. Prints its path.
  help           This text (also -h, --help).
";

pub enum Cmd {
    BuildEbpf,
    BenchConnect {
        rounds: usize,
        connects: usize,
    },
    /// `bench`, or `bench-run` (the measurement alone) or `bench-helper` (the processes
    /// the bench starts), handed to the bench crate with the arguments as they are,
    /// `--help` included, so its parser is the only one that knows its options.
    Bench {
        command: &'static str,
        args: Vec<OsString>,
    },
    Fuzz(FuzzArgs),
    Soak,
    /// `prometheus`: deploy/monitoring/'s Prometheus rather than `tunnel`.
    Image {
        prometheus: bool,
    },
    ShippedBinary,
    Help,
}

pub fn parse() -> Result<Cmd, lexopt::Error> {
    parse_from(lexopt::Parser::from_env())
}

fn parse_from(mut parser: lexopt::Parser) -> Result<Cmd, lexopt::Error> {
    let name = match parser.next()? {
        Some(Value(name)) => name.string()?,
        Some(Short('h') | Long("help")) => return Ok(Cmd::Help),
        Some(arg) => return Err(arg.unexpected()),
        None => return Err("no command given".into()),
    };
    let mut cmd = match name.as_str() {
        "build-ebpf" => Cmd::BuildEbpf,
        "bench-connect" => Cmd::BenchConnect {
            rounds: 10,
            connects: 2000,
        },
        "bench" => return bench("bench", &mut parser),
        "bench-run" => return bench("bench-run", &mut parser),
        "bench-helper" => return bench("bench-helper", &mut parser),
        "fuzz" => Cmd::Fuzz(FuzzArgs::default()),
        "soak" => Cmd::Soak,
        "image" => Cmd::Image { prometheus: false },
        "shipped-binary" => Cmd::ShippedBinary,
        "help" => Cmd::Help,
        _ => return Err(format!("no command `{name}`").into()),
    };
    while let Some(arg) = parser.next()? {
        match (&mut cmd, arg) {
            (_, Short('h') | Long("help")) => return Ok(Cmd::Help),
            // Once the flag for the profile `tunnel` embeds, now the only one: command
            // lines that spell it still work.
            (Cmd::BuildEbpf, Long("release")) => {}
            (Cmd::BenchConnect { rounds, .. }, Long("rounds")) => {
                *rounds = parser.value()?.parse()?;
            }
            (Cmd::BenchConnect { connects, .. }, Long("connects")) => {
                *connects = parser.value()?.parse()?;
            }
            (Cmd::Fuzz(args), Long("smoke")) => args.smoke = true,
            (Cmd::Fuzz(args), Long("target")) => args.targets.push(parser.value()?.string()?),
            (Cmd::Fuzz(args), Long("seconds")) => args.seconds = Some(parser.value()?.parse()?),
            (Cmd::Fuzz(args), Long("asan")) => args.asan = true,
            (Cmd::Image { prometheus }, Long("prometheus")) => *prometheus = true,
            (_, arg) => return Err(arg.unexpected()),
        }
    }
    Ok(cmd)
}

fn bench(command: &'static str, parser: &mut lexopt::Parser) -> Result<Cmd, lexopt::Error> {
    let args = parser.raw_args()?.collect();
    Ok(Cmd::Bench { command, args })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<Cmd, lexopt::Error> {
        parse_from(lexopt::Parser::from_args(line.split_whitespace()))
    }

    #[test]
    fn bench_commands_pass_every_argument_on() {
        for command in ["bench", "bench-run", "bench-helper"] {
            let line = format!("{command} --smoke --only=http,idle --runs 2 --help -- x");
            let Ok(Cmd::Bench {
                command: passed,
                args,
            }) = parse(&line)
            else {
                panic!("{line}: not a bench command");
            };
            assert_eq!(passed, command);
            let expected: Vec<OsString> = line.split_whitespace().skip(1).map(Into::into).collect();
            assert_eq!(args, expected);
        }
    }

    #[test]
    fn options_as_documented() {
        assert!(matches!(parse("build-ebpf"), Ok(Cmd::BuildEbpf)));
        assert!(matches!(parse("build-ebpf --release"), Ok(Cmd::BuildEbpf)));
        assert!(matches!(
            parse("bench-connect"),
            Ok(Cmd::BenchConnect {
                rounds: 10,
                connects: 2000
            })
        ));
        assert!(matches!(
            parse("bench-connect --rounds 3 --connects=50"),
            Ok(Cmd::BenchConnect {
                rounds: 3,
                connects: 50
            })
        ));
        let Ok(Cmd::Fuzz(fuzz)) = parse("fuzz --smoke --target frames --target=config --seconds 5")
        else {
            panic!("not fuzz");
        };
        assert!(fuzz.smoke && !fuzz.asan);
        assert_eq!(fuzz.targets, ["frames", "config"]);
        assert_eq!(fuzz.seconds, Some(5));
        assert!(matches!(parse("fuzz --asan"), Ok(Cmd::Fuzz(f)) if f.asan && !f.smoke));
        assert!(matches!(parse("soak"), Ok(Cmd::Soak)));
        assert!(matches!(
            parse("image"),
            Ok(Cmd::Image { prometheus: false })
        ));
        assert!(matches!(
            parse("image --prometheus"),
            Ok(Cmd::Image { prometheus: true })
        ));
        assert!(matches!(parse("shipped-binary"), Ok(Cmd::ShippedBinary)));
        for help in ["--help", "-h", "help", "fuzz --help", "build-ebpf -h"] {
            assert!(matches!(parse(help), Ok(Cmd::Help)), "{help}");
        }
    }

    #[test]
    fn mistakes_are_refused() {
        for line in [
            "",
            "nope",
            "build-ebpf --relase",
            "soak --release",
            "bench-connect --rounds x",
            "fuzz --seconds",
            "image extra",
            "shipped-binary --release",
        ] {
            assert!(parse(line).is_err(), "{line:?} accepted");
        }
    }
}
