//! `quotalease`: one binary, several subcommands (SPEC §3).

mod bench;
mod demo;
mod etcd;
mod run;
mod serve;
mod sim;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// A distributed rate limiter built on token leases.
#[derive(Parser, Debug)]
#[command(name = "quotalease", version, about)]
struct Cli {
    /// Accepted and ignored: rules with `concurrency` (in-flight limits)
    /// are served by default since session 35; this flag turned them on
    /// before, so scripts that pass it keep working.
    #[arg(long, global = true, hide = true)]
    experimental_permits: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run an allocator, six agents and a synthetic load in one process.
    Demo(DemoArgs),
    /// Run an allocator: the global one, or with --parent and --region a
    /// regional one that sub-leases its parent's leases to its region.
    Allocator(AllocatorArgs),
    /// Run the agent sidecar.
    Agent(AgentArgs),
    /// Work with rule files.
    Rules {
        #[command(subcommand)]
        command: RulesCommand,
    },
    /// Load an agent (gRPC Check, Envoy RLS or HTTP), open or closed loop,
    /// with HdrHistogram percentiles; or serve a do-nothing echo of the same
    /// interfaces (--serve-echo).
    Bench(bench::BenchArgs),
    /// Deterministic simulation of a scenario: the real allocator, regional
    /// and agent cores on a simulated clock and network. Writes report.md,
    /// CSV series and SVG plots; exits 1 if I1, I2 or I3 is broken.
    Sim(sim::SimArgs),
}

#[derive(Subcommand, Debug)]
enum RulesCommand {
    /// Validate a rules file: exit 0 with a summary, or 1 with every error.
    Validate {
        /// The YAML rules file.
        file: PathBuf,
    },
    /// Validate a rules file, print the diff against the rules live in
    /// etcd, and publish it there: allocators run with --etcd and no
    /// --rules apply it within a second (SPEC §3, §7).
    Publish {
        /// The YAML rules file.
        file: PathBuf,
        /// etcd endpoints (http://HOST:PORT, comma separated).
        #[arg(long, value_delimiter = ',', required = true)]
        etcd: Vec<String>,
        /// The allocators' --etcd-prefix.
        #[arg(long = "etcd-prefix", default_value = "/quotalease")]
        etcd_prefix: String,
    },
}

/// The longest duration any flag accepts: longer ones are typos, and
/// would overflow deadlines computed from them.
pub const MAX_FLAG_DURATION: Duration = Duration::from_secs(24 * 3600);

/// `K/N` of `--shard`: shard K of N, `K < N`, `2 <= N <= 1024`.
fn parse_shard(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{s:?} is not K/N (shard K of N shards, 0 <= K < N, 2 <= N <= 1024)");
    let (k, n) = s.split_once('/').ok_or_else(bad)?;
    let (k, n): (u32, u32) = (
        k.trim().parse().map_err(|_| bad())?,
        n.trim().parse().map_err(|_| bad())?,
    );
    if !(2..=1024).contains(&n) || k >= n {
        return Err(bad());
    }
    Ok((k, n))
}

/// Parse "250ms", "2s", "1m", "1h" (at most [`MAX_FLAG_DURATION`]).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))
        .unwrap_or((s, "s"));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a whole number with a unit, like 250ms or 2s"))?;
    let ms_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(format!("{s:?}: unit must be ms, s, m or h")),
    };
    let too_long = || format!("{s:?}: at most {}h", MAX_FLAG_DURATION.as_secs() / 3600);
    let ms = n.checked_mul(ms_per_unit).ok_or_else(too_long)?;
    let d = Duration::from_millis(ms);
    if d.is_zero() {
        return Err(format!("{s:?}: must be greater than zero"));
    }
    if d > MAX_FLAG_DURATION {
        return Err(too_long());
    }
    Ok(d)
}

/// Parse a fraction in (0, 1].
fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s
        .parse()
        .map_err(|_| format!("{s:?}: expected a number in (0, 1], like 0.25"))?;
    quotalease_agent::agent::check_fraction(f)
        .map(|()| f)
        .map_err(|_| format!("{s:?}: must be greater than 0 and at most 1"))
}

#[derive(Args, Debug)]
struct DemoArgs {
    /// How long the synthetic load runs.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    duration: Duration,
}

#[derive(Args, Debug)]
pub struct AllocatorArgs {
    /// gRPC address for agents (port 0 picks a free port; the chosen
    /// addresses are printed on stdout).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// YAML rules file, re-read on change. Required for the global
    /// allocator unless --etcd (then the rules published in etcd with
    /// `quotalease rules publish` are used when it is not given); for a
    /// regional one (--parent) optional bootstrap rules until the parent's
    /// arrive (without them it refuses children until then).
    #[arg(long)]
    rules: Option<PathBuf>,
    /// HTTP address for /metrics, /healthz, /readyz and /v1/keys.
    #[arg(long, default_value = "127.0.0.1:7071")]
    http: SocketAddr,
    /// Longest lease granted (TTL_max). A (re)started allocator grants
    /// nothing for this long (plus drift margin).
    #[arg(long = "ttl-max", default_value = "2s", value_parser = parse_duration)]
    ttl_max: Duration,
    /// The global allocator's state directory (locked; default
    /// quotalease-state/ADDR under the working directory, ADDR the
    /// --listen address). With no ledger in it a new ledger is created and
    /// buckets start full; with one (a restart), every key counts as fully
    /// leased out until the longest lease it may have granted has expired.
    #[arg(long = "state-dir")]
    state_dir: Option<PathBuf>,
    /// This is a new ledger: agents that name another ledger (a lost or
    /// replaced state directory) do not make this allocator wait the
    /// compiled TTL_max cap before granting. Only when that ledger's leases
    /// are known to be gone.
    #[arg(long = "new-ledger")]
    new_ledger: bool,
    /// The cluster this allocator serves (letters, digits, `.`, `_`, `-`;
    /// at most 128). Requesters of another cluster, or of none, are refused
    /// with an error naming both, and never make this allocator take its
    /// ledger for lost. Recorded in the state directory at the first
    /// start: later starts take it from there, and a different value is an
    /// error. Default: none (every requester is taken for one of its own).
    #[arg(long, value_parser = quotalease_allocator::durable::parse_cluster)]
    cluster: Option<String>,
    /// Parent allocator URL (http://HOST:PORT): makes this a regional
    /// allocator. Needs --region.
    #[arg(long)]
    parent: Option<String>,
    /// Region name; the regional talks to its parent as `region/NAME`.
    /// Needs --parent.
    #[arg(long)]
    region: Option<String>,
    /// mTLS: this allocator's certificate chain (PEM). With --tls-key and
    /// --tls-client-ca, agents (and child regionals) must present a client
    /// certificate signed by the client CA; files are re-read on change.
    #[arg(long = "tls-cert", value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// mTLS: the private key of --tls-cert (PEM).
    #[arg(long = "tls-key", value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// mTLS: the CA bundle (PEM) that signs the clients' certificates. A
    /// client's identity is its certificate's first URI SAN, else its first
    /// DNS SAN, plus its per-process nonce.
    #[arg(long = "tls-client-ca", value_name = "FILE")]
    tls_client_ca: Option<PathBuf>,
    /// Regional with mTLS: the CA bundle that signs the parent's
    /// certificate (default: --tls-client-ca). The regional presents
    /// --tls-cert to its parent, whose URL is then https://.
    #[arg(long = "tls-parent-ca", value_name = "FILE")]
    tls_parent_ca: Option<PathBuf>,
    /// etcd endpoints (http://HOST:PORT, comma separated): this is one of
    /// several replicas of the global allocator; they elect a leader
    /// through etcd, followers redirect agents to it, and the durable
    /// ledger is kept in etcd instead of a state directory (SPEC §7).
    #[arg(long, value_delimiter = ',')]
    etcd: Vec<String>,
    /// With --etcd: the URL agents reach this replica at (default
    /// http://LISTEN when --listen names an address).
    #[arg(long)]
    advertise: Option<String>,
    /// With --etcd: the prefix of every key this allocator keeps in etcd
    /// (one prefix per allocator cluster).
    #[arg(long = "etcd-prefix", default_value = "/quotalease")]
    etcd_prefix: String,
    /// With --etcd: this replica serves shard K of N (`K/N`, SPEC §7
    /// "Sharding"): keys are split over N shards by a hash of rule, tenant
    /// and route; each shard elects its own leader among its replicas and
    /// keeps its own ledger under `PREFIX/shard/K`. Every replica of the
    /// cluster must say the same N (recorded in etcd by the first). Agents
    /// learn the shards from any replica's replies.
    #[arg(long, value_parser = parse_shard)]
    shard: Option<(u32, u32)>,
    /// With --etcd: TTL of each replica's etcd lease. A dead leader is
    /// replaced after about this long; a leader that cannot renew it stops
    /// granting a third of it (at least 1 s) before it can expire.
    #[arg(long = "etcd-lease-ttl", default_value = "3s", value_parser = parse_duration)]
    etcd_lease_ttl: Duration,
    /// Regional: lease TTL asked of the parent.
    #[arg(long = "upstream-ttl", default_value = "2s", value_parser = parse_duration)]
    upstream_ttl: Duration,
    /// Regional: after a restart, resume the
    /// predecessor's parent slot leases so its agents' permits are renewed
    /// on (docs/permits.md "A regional restart"). Off by default: the limit
    /// holds only while one process of this region name is alive at a time
    /// (not during a rolling update's overlap, nor beside a partitioned old
    /// process).
    #[arg(long = "experimental-regional-resume")]
    experimental_regional_resume: bool,
    /// Regional: upstream planner tick (and the least gap between
    /// upstream messages that are not urgent).
    #[arg(long = "upstream-renew-interval", default_value = "50ms", value_parser = parse_duration)]
    upstream_renew_interval: Duration,
    /// Regional: ask the parent when a pool covers less than this much of
    /// its children's consumption, and renew a parent lease this long
    /// before its deadline.
    #[arg(long = "upstream-low-water", default_value = "500ms", value_parser = parse_duration)]
    upstream_low_water: Duration,
    /// Regional: bound of one call to the parent; a parent that has not
    /// answered for this long is reported unreachable.
    #[arg(long = "upstream-timeout", default_value = "500ms", value_parser = parse_duration)]
    upstream_timeout: Duration,
}

#[derive(Args, Debug)]
pub struct AgentArgs {
    /// Allocator URL(s), comma separated (http://HOST:PORT, or
    /// https://HOST:PORT with the --tls flags).
    #[arg(long, value_delimiter = ',', required = true)]
    allocator: Vec<String>,
    /// gRPC address for quotalease.v1.RateLimiter/Check and Envoy's
    /// envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit.
    #[arg(long, default_value = "127.0.0.1:7080")]
    grpc: SocketAddr,
    /// HTTP address for /metrics, /healthz, /readyz.
    #[arg(long, default_value = "127.0.0.1:7081")]
    http: SocketAddr,
    /// Rules to use until the allocator is reached (optional).
    #[arg(long)]
    rules: Option<PathBuf>,
    /// mTLS towards the allocator: this agent's client certificate (PEM);
    /// with --tls-key and --tls-ca, and https:// allocator URLs. Files are
    /// re-read on change.
    #[arg(long = "tls-cert", value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// mTLS: the private key of --tls-cert (PEM).
    #[arg(long = "tls-key", value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// mTLS: the CA bundle (PEM) that signs the allocator's certificate,
    /// which must name the allocator URL's host.
    #[arg(long = "tls-ca", value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// Agent id sent to the allocator (default: agent-HOSTPID).
    #[arg(long = "agent-id")]
    agent_id: Option<String>,
    /// The cluster this agent belongs to (as the allocator's --cluster):
    /// presented to the allocator, and replies of another cluster are not
    /// used. Default: none.
    #[arg(long, value_parser = quotalease_allocator::durable::parse_cluster)]
    cluster: Option<String>,
    /// Lease lifetime requested.
    #[arg(long = "lease-ttl", default_value = "2s", value_parser = parse_duration)]
    lease_ttl: Duration,
    /// Background renewal tick.
    #[arg(long = "renew-interval", default_value = "50ms", value_parser = parse_duration)]
    renew_interval: Duration,
    /// Renew when the lease covers less than this much of the key's recent consumption.
    #[arg(long = "low-water", default_value = "100ms", value_parser = parse_duration)]
    low_water: Duration,
    /// How long a request waits for a missing lease; bound of one allocator call.
    #[arg(long = "fetch-timeout", default_value = "250ms", value_parser = parse_duration)]
    fetch_timeout: Duration,
    /// Release and forget keys idle this long.
    #[arg(long = "idle-release", default_value = "10s", value_parser = parse_duration)]
    idle_release: Duration,
    /// Ask the allocator for leases that carry a rate (`--rate-leases
    /// false`: leases of tokens only; see docs/protocol.md).
    #[arg(long = "rate-leases", default_value_t = true, action = clap::ArgAction::Set)]
    rate_leases: bool,
    /// Fail-open emergency bucket rate, as a fraction of each rule's rate
    /// (default: max(this agent's recent share, R / agents using the key)).
    #[arg(long = "emergency-rate", value_parser = parse_fraction)]
    emergency_rate: Option<f64>,
    /// Fail-open emergency bucket burst, as a fraction of each rule's burst
    /// (default: B / agents using the key).
    #[arg(long = "emergency-burst", value_parser = parse_fraction)]
    emergency_burst: Option<f64>,
    /// Envoy RLS: the descriptor entry key that names the tenant.
    #[arg(long = "envoy-tenant-key", default_value = "tenant")]
    envoy_tenant_key: String,
    /// Envoy RLS: the descriptor entry key that names the route.
    #[arg(long = "envoy-route-key", default_value = "route")]
    envoy_route_key: String,
    /// Test only: append every admission to this file.
    #[arg(long = "admission-log", hide = true)]
    admission_log: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let _ = cli.experimental_permits;
    // The demo prints its own progress; keep its log to warnings unless asked.
    let is_sim = matches!(cli.command, Command::Sim(_));
    let default_level = if is_sim {
        // Hundreds of simulated agents would each log every outage.
        "error"
    } else if matches!(cli.command, Command::Demo(_)) {
        "warn"
    } else {
        "info"
    };
    let env = std::env::var("RUST_LOG").unwrap_or_default();
    let mut filter = tracing_subscriber::EnvFilter::try_new(&env)
        .ok()
        .filter(|_| !env.trim().is_empty())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new(default_level));
    let above_warn = filter
        .max_level_hint()
        .is_none_or(|h| h > tracing_subscriber::filter::LevelFilter::WARN);
    if is_sim && above_warn {
        // The simulator's output is its report and its progress: the
        // production cores it drives (hundreds of agents, the allocators)
        // log at most warnings, whatever RUST_LOG says, unless RUST_LOG
        // names their crate.
        for krate in ["quotalease_agent", "quotalease_allocator"] {
            if !env.contains(krate) {
                filter = filter.add_directive(
                    format!("{krate}=warn")
                        .parse()
                        .expect("a crate name and a level form a valid directive"),
                );
            }
        }
    }
    // Colours only on a terminal: a log file or journald gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Rules {
            command: RulesCommand::Validate { file },
        } => serve::validate(&file),
        Command::Rules {
            command:
                RulesCommand::Publish {
                    file,
                    etcd,
                    etcd_prefix,
                },
        } => runtime().and_then(|rt| rt.block_on(etcd::publish(&file, &etcd, &etcd_prefix))),
        Command::Demo(args) => runtime().and_then(|rt| rt.block_on(demo::run(args.duration))),
        Command::Allocator(args) => runtime().and_then(|rt| rt.block_on(run::allocator(args))),
        Command::Agent(args) => runtime().and_then(|rt| rt.block_on(run::agent(args))),
        Command::Bench(args) => runtime().and_then(|rt| rt.block_on(bench::run(args))),
        Command::Sim(args) => sim::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quotalease: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}
