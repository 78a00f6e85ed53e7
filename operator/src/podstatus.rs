//! A forwarder pod's `/status` over HTTP: which pods to ask (those their group's StatefulSet
//! controls), where, and the bounded read. The data-plane poller and the hand-over's observe
//! step both ask through it.

use std::time::Duration;

use bytes::Bytes;
use ferry_api::status::{ForwarderStatus, STATUS_PATH};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::Pod;
use kube::{Resource, ResourceExt};

use crate::render::HTTP_PORT;

const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// A `/status` body is a few KiB, a few MiB for thousands of rules in an outage; see
/// `STATUS_MAX_BYTES` for the bound (only pods of the group's StatefulSet are read).
const MAX_BODY: usize = ferry_api::status::STATUS_MAX_BYTES;

/// Whether `pod`'s controller is the StatefulSet whose uid is `uid` (a pod's owner reference
/// holds the uid; its name alone could be anyone's).
pub(crate) fn owned_by(pod: &Pod, uid: &str) -> bool {
    !uid.is_empty()
        && pod.owner_references().iter().any(|o| {
            o.controller == Some(true)
                && o.kind == "StatefulSet"
                && o.api_version == "apps/v1"
                && o.uid == uid
        })
}

/// `http://<pod IP>:<port named http>/status`, for every pod with an IP that is not being
/// deleted, ready or not: a forwarder that lost its broker is exactly the one whose report
/// says why.
pub(crate) fn status_url(pod: &Pod) -> Option<String> {
    if pod.meta().deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ip = status.pod_ip.as_ref()?;
    let port = pod
        .spec
        .as_ref()?
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some("http"))
        .map_or(i32::from(HTTP_PORT), |p| p.container_port);
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.clone()
    };
    Some(format!("http://{host}:{port}{STATUS_PATH}"))
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    #[error("bad URL: {0}")]
    Url(#[from] hyper::http::uri::InvalidUri),
    #[error("request: {0}")]
    Request(#[from] hyper_util::client::legacy::Error),
    #[error("no answer within {REQUEST_TIMEOUT:?}")]
    Timeout,
    #[error("HTTP {0}")]
    Status(hyper::StatusCode),
    #[error("body: {0}")]
    Body(String),
    #[error("not a forwarder status: {0}")]
    Json(#[from] serde_json::Error),
}

/// One pod's `/status`, if it has an address and answers.
pub(crate) async fn pod_status(pod: &Pod) -> Option<ForwarderStatus> {
    let http: HttpClient<HttpConnector, Empty<Bytes>> =
        HttpClient::builder(TokioExecutor::new()).build_http();
    fetch(&http, &status_url(pod)?).await.ok()
}

pub(crate) async fn fetch(
    http: &HttpClient<HttpConnector, Empty<Bytes>>,
    url: &str,
) -> Result<ForwarderStatus, FetchError> {
    let request = async {
        let response = http.get(url.parse()?).await?;
        if !response.status().is_success() {
            return Err(FetchError::Status(response.status()));
        }
        let body = Limited::new(response.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| FetchError::Body(e.to_string()))?
            .to_bytes();
        Ok(serde_json::from_slice(&body)?)
    };
    tokio::time::timeout(REQUEST_TIMEOUT, request)
        .await
        .map_err(|_| FetchError::Timeout)?
}
