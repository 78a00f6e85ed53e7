//! `ferry-operator`: reconciles BrokerConnections and ForwardingRules into forwarder
//! StatefulSets. Connects with the in-cluster service account, or `KUBECONFIG` outside.
//!
//! With leader election (the default) only the replica holding the Lease reconciles; the
//! others wait. Losing the Lease exits (status 1) so a restart starts clean; SIGTERM releases
//! it, so a standby takes over without waiting for it to expire.

use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use ferry_operator::dataplane::Polling;
use ferry_operator::image::ForwarderImage;
use ferry_operator::metrics::Metrics;
use ferry_operator::netpol::{ForwarderNetworkPolicy, NetworkPolicyArgs};
use ferry_operator::release;
use ferry_operator::scope::Scope;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::sync::watch;
use tracing::{error, info, warn};
use tracing_subscriber::EnvFilter;

#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "FERRY_OPERATOR_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// Reconcile only while holding the Lease (for more than one replica).
    #[arg(long, env = "FERRY_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// Name of the Lease.
    #[arg(long, env = "FERRY_LEASE_NAME", default_value = "ferry-operator")]
    lease_name: String,
    /// Namespace of the Lease; default: the service account's namespace (or the kubeconfig's).
    #[arg(long, env = "POD_NAMESPACE")]
    lease_namespace: Option<String>,
    /// How long a Lease lasts without renewal: the longest a crashed leader blocks a standby.
    #[arg(long, env = "FERRY_LEASE_DURATION_SECONDS", default_value_t = 15)]
    lease_duration_seconds: u64,
    /// This replica's name in the Lease and in Events; default: host name and process id.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// How often each forwarder pod's /status is read into its rules' status.
    #[arg(long, env = "FERRY_STATUS_INTERVAL_SECONDS", default_value_t = 10)]
    status_interval_seconds: u64,
    /// The least time between two writes of a rule's counters and rate while only they move;
    /// a condition change is written at the next poll regardless. 0 writes every change.
    #[arg(
        long,
        env = "FERRY_STATUS_WRITE_INTERVAL_SECONDS",
        default_value_t = 60
    )]
    status_write_interval_seconds: u64,
    /// The status writes a second the whole operator may send the API server. Condition
    /// changes (and `Accepted`/`Ready`) are written at once and count against it; writes of
    /// moving counters only wait for room, oldest first. 0: no limit.
    #[arg(
        long,
        env = "FERRY_STATUS_WRITES_PER_SECOND",
        default_value_t = 20.0,
        value_parser = writes_per_second
    )]
    status_writes_per_second: f64,
    /// How often the literal Kafka topics of rules not yet served are checked again (a rule
    /// whose topic is missing is refused, `TopicMissing`, until it exists); a rule's or its
    /// connection's change checks at once. Each check is one metadata request per connection.
    #[arg(long, env = "FERRY_TOPIC_CHECK_INTERVAL_SECONDS", default_value_t = 60)]
    topic_check_interval_seconds: u64,
    /// Namespaces to watch, comma-separated: the operator lists, watches and changes nothing
    /// outside them, so a Role in each is all it needs. Empty or unset: every namespace.
    #[arg(
        long,
        env = "FERRY_WATCH_NAMESPACES",
        value_name = "NAMESPACES",
        value_parser = Scope::parse,
        global = true
    )]
    watch_namespaces: Option<Scope>,
    /// `text` or `json`.
    #[arg(long, env = "FERRY_LOG_FORMAT", default_value = "text", global = true)]
    log_format: LogFormat,
    #[command(flatten)]
    forwarder_image: ForwarderImage,
    #[command(flatten)]
    network_policy: NetworkPolicyArgs,
    #[command(subcommand)]
    command: Option<Subcommand>,
}

#[derive(clap::Subcommand, Debug)]
enum Subcommand {
    /// Before the operator is uninstalled (the chart's pre-delete hook): stop it, then remove
    /// its finalizer from every BrokerConnection in scope (`--watch-namespaces`), marking each
    /// `ferry.dev/finalizer-released-at`, so that deleting them later completes without an
    /// operator. Their forwarders keep running until then; their MQTT sessions are no longer
    /// ended on deletion (they end by their expiry). A reinstalled operator puts the finalizer
    /// back.
    ReleaseFinalizers(ReleaseArgs),
}

#[derive(clap::Args, Debug)]
struct ReleaseArgs {
    /// The operator Deployment to scale to 0 first: a running operator would put its
    /// finalizer straight back.
    #[arg(long, requires = "operator_selector")]
    operator_deployment: Option<String>,
    /// Label selector of the operator's pods: none may be left (terminating ones included)
    /// before the finalizers are removed.
    #[arg(long, requires = "operator_deployment")]
    operator_selector: Option<String>,
    /// Namespace of the operator Deployment; default: the service account's (or the
    /// kubeconfig's).
    #[arg(long, env = "POD_NAMESPACE")]
    operator_namespace: Option<String>,
    /// How long to wait for the operator's pods to be gone.
    #[arg(long, default_value_t = 120)]
    stop_timeout_seconds: u64,
}

/// `--status-writes-per-second`: a number, 0 or more.
fn writes_per_second(value: &str) -> Result<f64, String> {
    match value.trim().parse::<f64>() {
        Ok(n) if n.is_finite() && n >= 0.0 => Ok(n),
        _ => Err(format!(
            "{value:?} is not a number of writes a second (0 or more; 0 is no limit)"
        )),
    }
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum LogFormat {
    Text,
    Json,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_from_env("FERRY_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => builder.init(),
        // One flat object per line (`message` and the event's fields at the top level), as log
        // pipelines index them; the code logs its context as fields, not spans.
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
    let result = match args.command {
        Some(Subcommand::ReleaseFinalizers(ref release)) => {
            release_finalizers(release, args.watch_namespaces.clone().unwrap_or_default()).await
        }
        None => run(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = %e, "stopping");
            eprintln!("ferry-operator: {e}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("cannot reach the Kubernetes API: {0}")]
    Client(#[source] kube::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("leader election on Lease {namespace}/{name}: {source}")]
    Lease {
        namespace: String,
        name: String,
        source: kube_lease_manager::LeaseManagerError,
    },
    #[error("lost the leader Lease; exiting so that a restart starts clean")]
    LostLease,
    #[error("--lease-duration-seconds must be at least 3")]
    LeaseTooShort,
    #[error(transparent)]
    NetworkPolicy(#[from] ferry_operator::netpol::PolicyError),
    #[error(transparent)]
    Release(#[from] ferry_operator::release::Error),
}

/// `release-finalizers`: see [`Subcommand::ReleaseFinalizers`].
async fn release_finalizers(args: &ReleaseArgs, scope: Scope) -> Result<(), Error> {
    let client = kube::Client::try_default().await.map_err(Error::Client)?;
    if let (Some(deployment), Some(selector)) = (&args.operator_deployment, &args.operator_selector)
    {
        let operator = release::Operator {
            namespace: args
                .operator_namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_owned()),
            deployment: deployment.clone(),
            selector: selector.clone(),
        };
        release::stop_operator(
            &client,
            &operator,
            Duration::from_secs(args.stop_timeout_seconds),
        )
        .await?;
    }
    let released = release::release_finalizers(&client, &scope).await?;
    info!(%scope, released = released.len(), connections = ?released, "released the finalizer of every BrokerConnection in scope");
    Ok(())
}

async fn run(args: Args) -> Result<(), Error> {
    let client = kube::Client::try_default().await.map_err(Error::Client)?;
    let own_namespace = args
        .lease_namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let network_policy = args.network_policy.resolve(Some(&own_namespace))?;
    let metrics = Arc::new(Metrics::new());
    serve_metrics(args.listen, Arc::clone(&metrics)).await?;
    let mut reconciler = Reconciler::new(&args, client, metrics);
    if let Some(p) = &network_policy {
        info!(operator_namespace = %p.operator_namespace, operator_pods = ?p.operator_pods, metrics_from = p.metrics_from.len(), "forwarder NetworkPolicies: ingress to their http port only from these");
    }
    reconciler.network_policy = network_policy;
    if !args.leader_elect {
        reconciler.metrics.set_ready();
        reconciler.metrics.set_leader(true);
        reconciler.run(terminated()).await;
        return Ok(());
    }
    if args.lease_duration_seconds < 3 {
        return Err(Error::LeaseTooShort);
    }
    let namespace = own_namespace;
    let manager = lease_manager(&args, &reconciler, &namespace).await?;
    let (mut leading, lease_task) = manager.watch().await;
    reconciler.metrics.set_ready();
    info!(lease = %args.lease_name, namespace = %namespace, identity = %reconciler.identity, "waiting for the leader Lease");
    let outcome = tokio::select! {
        () = terminated() => Ok(()),
        result = lead(&mut leading, reconciler) => result,
    };
    // Dropping the receiver makes the lease task release the Lease and end.
    drop(leading);
    match tokio::time::timeout(Duration::from_secs(5), lease_task).await {
        Ok(Ok(Ok(_))) => info!("released the leader Lease"),
        Ok(Ok(Err(e))) => warn!(error = %e, "could not release the leader Lease"),
        Ok(Err(e)) => warn!(error = %e, "lease task failed"),
        Err(_) => warn!("releasing the leader Lease timed out"),
    }
    outcome
}

async fn serve_metrics(listen: SocketAddr, metrics: Arc<Metrics>) -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| Error::Listen {
            addr: listen,
            source,
        })?;
    info!(listen = %listen, "serving /metrics, /healthz, /readyz");
    tokio::spawn(ferry_operator::metrics::serve(listener, metrics));
    Ok(())
}

/// What the controller runs with, with or without leader election.
struct Reconciler {
    client: kube::Client,
    scope: Scope,
    metrics: Arc<Metrics>,
    status_polling: Polling,
    /// This replica's name in the Lease and in Events.
    identity: String,
    forwarder_image: ForwarderImage,
    network_policy: Option<ForwarderNetworkPolicy>,
    /// How often rules' literal Kafka topics are checked again.
    topic_check_interval: Duration,
}

impl Reconciler {
    fn new(args: &Args, client: kube::Client, metrics: Arc<Metrics>) -> Self {
        let identity = args.identity.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}-{}", host.trim(), std::process::id())
        });
        let status_polling = Polling {
            interval: Duration::from_secs(args.status_interval_seconds.max(1)),
            min_write_interval: Duration::from_secs(args.status_write_interval_seconds),
            writes_per_second: args.status_writes_per_second,
        };
        let scope = args.watch_namespaces.clone().unwrap_or_default();
        info!(%scope, "watching");
        info!(image = %args.forwarder_image.image, pull_policy = ?args.forwarder_image.pull_policy, pull_secrets = ?args.forwarder_image.pull_secrets, "forwarder image of connections that name none");
        Self {
            client,
            scope,
            metrics,
            status_polling,
            identity,
            forwarder_image: args.forwarder_image.clone(),
            network_policy: None,
            topic_check_interval: Duration::from_secs(args.topic_check_interval_seconds.max(1)),
        }
    }

    /// Reconciles until `shutdown` completes.
    async fn run(self, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
        ferry_operator::controller::run(
            self.client,
            self.scope,
            self.metrics,
            self.status_polling,
            self.identity,
            (
                self.forwarder_image,
                self.network_policy,
                self.topic_check_interval,
            ),
            shutdown,
        )
        .await;
    }
}

async fn lease_manager(
    args: &Args,
    reconciler: &Reconciler,
    namespace: &str,
) -> Result<LeaseManager, Error> {
    let identity = &reconciler.identity;
    LeaseManagerBuilder::new(reconciler.client.clone(), &args.lease_name)
        .with_namespace(namespace)
        .with_identity(identity)
        .with_duration(args.lease_duration_seconds)
        // Renew with a third of the lease left: two chances before it lapses.
        .with_grace((args.lease_duration_seconds / 3).max(1))
        .with_field_manager(format!("ferry-operator-lease-{identity}"))
        .build()
        .await
        .map_err(|source| Error::Lease {
            namespace: namespace.to_owned(),
            name: args.lease_name.clone(),
            source,
        })
}

/// Waits for the Lease, then reconciles until SIGTERM or until the Lease is lost (an error:
/// the process exits so that a restart starts clean).
async fn lead(leading: &mut watch::Receiver<bool>, reconciler: Reconciler) -> Result<(), Error> {
    while !*leading.borrow_and_update() {
        if leading.changed().await.is_err() {
            return Err(Error::LostLease);
        }
    }
    info!(identity = %reconciler.identity, "leading: reconciling");
    let metrics = Arc::clone(&reconciler.metrics);
    metrics.set_leader(true);
    let mut lost = leading.clone();
    let lost = async move {
        while *lost.borrow_and_update() {
            if lost.changed().await.is_err() {
                break;
            }
        }
    };
    let stop = async {
        tokio::select! {
            () = terminated() => false,
            () = lost => true,
        }
    };
    // The controller takes a shutdown future without a result: which of the two stopped it
    // comes back on this channel.
    let (lost_tx, lost_rx) = tokio::sync::oneshot::channel();
    let shutdown = async move {
        let lost = stop.await;
        let _ = lost_tx.send(lost);
    };
    reconciler.run(Box::pin(shutdown)).await;
    metrics.set_leader(false);
    match lost_rx.await {
        Ok(true) => Err(Error::LostLease),
        _ => Ok(()),
    }
}

/// SIGTERM (Kubernetes stopping the pod) or Ctrl-C.
async fn terminated() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                warn!(error = %e, "cannot watch SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    info!("stopping");
}
