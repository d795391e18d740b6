//! The sidecar's connections to the application.
//!
//! Many application servers (Python's http.server among them) write a response's headers and
//! body in two sends with Nagle's algorithm on: the body waits until the headers are
//! acknowledged. A fresh connection acknowledges at once, but on a pooled keep-alive connection
//! Linux delays the ACK by up to 40 ms — so every request through the sidecar would stall 40 ms
//! that a direct client on a new connection never sees. The sidecar cannot turn the
//! application's Nagle off, so it acknowledges at once instead, when it is kept waiting: each
//! response carries an [`Acknowledger`] of its connection, and a body that is not all there when
//! the proxy asks for it sets TCP_QUICKACK, which sends the pending ACK now.
//!
//! Not after every read: a response that arrives whole (most of them) needs no ACK of its own
//! (the next request on the connection carries it), and a TCP_QUICKACK per response was 7% of
//! the sidecar's CPU, one syscall and one extra packet each.

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Sends a connection's pending ACK on demand, from wherever its response is read: the proxy
/// holds it in the response's extensions while hyper's connection task owns the socket. It holds
/// a duplicate of the socket's descriptor (the same socket), closed when the connection is, so
/// that it never keeps the connection open.
#[derive(Clone, Debug)]
pub struct Acknowledger(Arc<parking_lot::Mutex<Option<OwnedFd>>>);

impl Acknowledger {
    /// Acknowledges what the connection has received, now (nothing once it is closed).
    pub fn acknowledge(&self) {
        if let Some(socket) = &*self.0.lock() {
            // Best effort: on a platform without the option the stall stays, nothing breaks.
            let _ = socket2::SockRef::from(socket).set_tcp_quickack(true);
        }
    }
}

/// The application connection, whose [`Acknowledger`] each response carries.
pub struct AppConnection {
    stream: TcpStream,
    acknowledger: Acknowledger,
}

impl Drop for AppConnection {
    fn drop(&mut self) {
        // The duplicate would keep the socket open after the stream closes its descriptor.
        self.acknowledger.0.lock().take();
    }
}

impl AsyncRead for AppConnection {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for AppConnection {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, data)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl Connection for AppConnection {
    fn connected(&self) -> Connected {
        self.stream.connected().extra(self.acknowledger.clone())
    }
}

/// hyper-util's connector, yielding [`AppConnection`] streams.
#[derive(Clone)]
pub struct UpstreamConnector(pub HttpConnector);

type Connecting =
    Pin<Box<dyn Future<Output = Result<TokioIo<AppConnection>, Box<dyn std::error::Error + Send + Sync>>> + Send>>;

impl tower::Service<Uri> for UpstreamConnector {
    type Response = TokioIo<AppConnection>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = Connecting;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower::Service::<Uri>::poll_ready(&mut self.0, cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = tower::Service::<Uri>::call(&mut self.0, uri);
        Box::pin(async move {
            let stream = connecting.await?.into_inner();
            // Without a duplicate (no descriptors left), responses are just never acknowledged early.
            let duplicate = stream.as_fd().try_clone_to_owned().ok();
            let acknowledger = Acknowledger(Arc::new(parking_lot::Mutex::new(duplicate)));
            Ok(TokioIo::new(AppConnection { stream, acknowledger }))
        })
    }
}
