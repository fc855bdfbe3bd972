//! The accept loop: HTTP/1 connections with read deadlines and a
//! connection limit, so slow or idle clients cannot hold the server.
//!
//! `axum::serve` has neither: a client sending its headers (or body) a
//! byte at a time held a connection, and a task, forever. Here a
//! connection's request headers must arrive within
//! [`ConnLimits::header_timeout`] (also the idle time allowed between
//! keep-alive requests), a request body within [`ConnLimits::body_timeout`]
//! of its headers (in total, however it trickles), and at most
//! [`ConnLimits::max_connections`] are served at once: one more is answered
//! `503` and closed at once. Graceful shutdown as `axum::serve` does it:
//! stop accepting, let open connections finish their requests.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tower_service::Service;

/// What a connection may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Most time for a request's headers, from its first byte or from the
    /// end of the previous request on the connection.
    pub header_timeout: Duration,
    /// Most time for a request's whole body, from the end of its headers.
    pub body_timeout: Duration,
    /// Most connections served at once.
    pub max_connections: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            max_connections: 128,
        }
    }
}

/// The error a request body gives once its deadline passes.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyTimedOut(pub Duration);

/// Whether `e`, or an error it wraps, is a [`BodyTimedOut`].
pub fn is_body_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(e) = cur {
        if e.is::<BodyTimedOut>() {
            return true;
        }
        cur = e.source();
    }
    false
}

/// A request body that fails once its deadline passes.
struct DeadlineBody {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
}

impl hyper::body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(BodyTimedOut(self.timeout).into()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// What a connection over the limit is told before it is closed.
fn busy_response() -> Vec<u8> {
    let body = r#"{"error":{"message":"too many connections to this server; retry shortly","type":"overloaded_error"}}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serves `router` on `listener` until `shutdown` completes, then waits for
/// the open connections' requests to finish.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Dropping `signal_rx` tells connections to finish; each connection
    // holds a `close_rx` until it ends.
    let (signal_tx, signal_rx) = watch::channel(());
    tokio::spawn(async move {
        shutdown.await;
        drop(signal_rx);
    });
    let (close_tx, close_rx) = watch::channel(());
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = signal_tx.closed() => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: let some close.
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // A fresh socket's send buffer takes this whole; what the
            // client sent is never read.
            let _ = stream.try_write(&busy_response());
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let signal_tx = signal_tx.clone();
        let close_rx = close_rx.clone();
        tokio::spawn(async move {
            let body_timeout = limits.body_timeout;
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let req: Request = req.map(|inner| {
                    Body::new(DeadlineBody {
                        inner,
                        deadline: Box::pin(tokio::time::sleep(body_timeout)),
                        timeout: body_timeout,
                    })
                });
                let mut router = router.clone();
                async move { Ok::<_, Infallible>(router.call(req).await.unwrap_or_else(|e| match e {})) }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            let mut stopping = std::pin::pin!(signal_tx.closed());
            let mut stopped = false;
            loop {
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            tracing::debug!("connection ended: {e}");
                        }
                        break;
                    }
                    _ = &mut stopping, if !stopped => {
                        stopped = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(close_rx);
            drop(slot);
        });
    }
    drop(close_rx);
    drop(listener);
    close_tx.closed().await;
}
