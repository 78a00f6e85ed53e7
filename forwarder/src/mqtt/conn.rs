//! One connection to the broker: TCP (or TLS over TCP), a read buffer and a write buffer. Packets
//! are encoded into the write buffer and go out with one write and flush.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use super::wire::{Codec, Incoming, WireError};
use crate::tls;

/// A write that does not complete within this means the connection is dead (the broker stopped
/// reading, or the network is gone).
pub const WRITE_BOUND: Duration = Duration::from_secs(10);
/// Reads ask for at least this much room, so a burst of PUBLISHes takes few reads.
const READ_CHUNK: usize = 64 * 1024;

trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// Why a connection could not be made or was lost. Only [`ConnError::is_permanent`] ones make a
/// decision (the forwarder stops); the rest are retried, and their text is for logs and /status.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The broker's certificate did not verify.
    #[error("TLS certificate verification failed: {0}")]
    Certificate(rustls::Error),
    /// The broker refused the CONNECT (credentials, client id, authorization), with the name of
    /// its return code.
    #[error("connection refused: {code}")]
    Refused { code: String },
    /// A socket operation failed (`op`: what the driver was doing).
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        source: std::io::Error,
    },
    #[error("tls server name {host:?}: {source}")]
    ServerName {
        host: String,
        source: rustls::pki_types::InvalidDnsNameError,
    },
    #[error("the broker closed the connection")]
    Closed,
    #[error("write did not complete within {0:?}")]
    WriteTimeout(Duration),
    #[error("no CONNACK within {0:?}")]
    NoConnAck(Duration),
    /// Nothing arrived for 1.5 × keep-alive while the driver was reading.
    #[error("nothing from the broker for 1.5 × keep-alive ({keep_alive:?}) while reading")]
    Silent { keep_alive: Duration },
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("the broker's first packet was not a CONNACK")]
    NotConnAck,
    #[error("a second CONNACK from the broker")]
    SecondConnAck,
    /// The broker ended the connection, with its reason.
    #[error("the broker sent DISCONNECT ({0})")]
    Disconnected(String),
}

impl ConnError {
    pub fn io(op: &'static str, source: std::io::Error) -> Self {
        Self::Io { op, source }
    }

    /// Retrying cannot fix it: the broker's certificate does not verify, or the broker refuses
    /// our CONNECT. Whether the forwarder stops on it is the driver's call (only before the
    /// first successful connection).
    pub fn is_permanent(&self) -> bool {
        matches!(self, Self::Certificate(_) | Self::Refused { .. })
    }
}

pub struct Conn {
    io: Box<dyn Io>,
    pub read_buf: BytesMut,
    pub write_buf: BytesMut,
}

impl Conn {
    /// Opens TCP, and TLS over it when `tls` is set (the host name is what the certificate must
    /// name).
    pub async fn open(
        host: &str,
        port: u16,
        tls: Option<&Arc<rustls::ClientConfig>>,
    ) -> Result<Self, ConnError> {
        let tcp = TcpStream::connect((host, port))
            .await
            .map_err(|e| ConnError::io("tcp connect", e))?;
        // Acks are small and must leave at once, not wait for Nagle.
        tcp.set_nodelay(true)
            .map_err(|e| ConnError::io("tcp nodelay", e))?;
        let io: Box<dyn Io> = match tls {
            None => Box::new(tcp),
            Some(config) => {
                let name = ServerName::try_from(host.to_owned()).map_err(|source| {
                    ConnError::ServerName {
                        host: host.to_owned(),
                        source,
                    }
                })?;
                let stream = TlsConnector::from(Arc::clone(config))
                    .connect(name, tcp)
                    .await
                    .map_err(|e| match tls::certificate_error(&e) {
                        Some(refused) => ConnError::Certificate(refused),
                        None => ConnError::io("TLS", e),
                    })?;
                Box::new(stream)
            }
        };
        Ok(Self {
            io,
            read_buf: BytesMut::with_capacity(READ_CHUNK),
            write_buf: BytesMut::with_capacity(4096),
        })
    }

    /// Writes and flushes the write buffer, within `WRITE_BOUND`.
    pub async fn flush(&mut self) -> Result<(), ConnError> {
        if self.write_buf.is_empty() {
            return Ok(());
        }
        let io = &mut self.io;
        let buf = &self.write_buf;
        let written = tokio::time::timeout(WRITE_BOUND, async {
            io.write_all(buf).await?;
            io.flush().await
        })
        .await;
        self.write_buf.clear();
        match written {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ConnError::io("write", e)),
            Err(_) => Err(ConnError::WriteTimeout(WRITE_BOUND)),
        }
    }

    /// Reads what the socket has into the read buffer. Cancel safe. End of stream is an error.
    pub async fn read(&mut self) -> Result<(), ConnError> {
        if self.read_buf.capacity() - self.read_buf.len() < READ_CHUNK / 4 {
            self.read_buf.reserve(READ_CHUNK);
        }
        match self.io.read_buf(&mut self.read_buf).await {
            Ok(0) => Err(ConnError::Closed),
            Ok(_) => Ok(()),
            Err(e) => Err(ConnError::io("read", e)),
        }
    }

    /// Reads until one whole packet is buffered and decodes it (for the CONNACK).
    pub async fn read_packet(&mut self, codec: Codec) -> Result<Incoming, ConnError> {
        loop {
            if let Some(packet) = codec.decode(&mut self.read_buf)? {
                return Ok(packet);
            }
            self.read().await?;
        }
    }
}
