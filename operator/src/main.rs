//! `ferry-operator`: reconciles BrokerConnections and ForwardingRules into forwarder
//! StatefulSets. Connects with the in-cluster service account, or `KUBECONFIG` outside.

use std::process::ExitCode;

use tracing::error;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("FERRY_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            error!(error = %e, "cannot reach the Kubernetes API");
            eprintln!("ferry-operator: cannot reach the Kubernetes API: {e}");
            return ExitCode::FAILURE;
        }
    };
    tokio::select! {
        () = ferry_operator::controller::run(client) => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    ExitCode::SUCCESS
}
