//! The sidecar's connections to the application.
//!
//! Many application servers (Python's http.server among them) write a response's headers and
//! body in two sends with Nagle's algorithm on: the body waits until the headers are
//! acknowledged. A fresh connection acknowledges at once, but on a pooled keep-alive connection
//! Linux delays the ACK by up to 40 ms — so every request through the sidecar would stall 40 ms
//! that a direct client on a new connection never sees. The sidecar cannot turn the
//! application's Nagle off, so it acknowledges at once instead: TCP_QUICKACK on its side of the
//! connection, re-armed after every read that received data, because Linux leaves quick-ack mode
//! again by itself. (Not after a read that found nothing: hyper polls until `Pending`, and a
//! setsockopt per poll was a third of the sidecar's syscalls.)

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A TCP stream that acknowledges what it receives without delay.
pub struct QuickAck(TcpStream);

impl QuickAck {
    fn rearm(&self) {
        // Best effort: on a platform without the option the stall stays, nothing breaks.
        let _ = socket2::SockRef::from(&self.0).set_tcp_quickack(true);
    }
}

impl AsyncRead for QuickAck {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.0).poll_read(cx, buf);
        if matches!(poll, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.rearm();
        }
        poll
    }
}

impl AsyncWrite for QuickAck {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, data)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl Connection for QuickAck {
    fn connected(&self) -> Connected {
        self.0.connected()
    }
}

/// hyper-util's connector, yielding [`QuickAck`] streams.
#[derive(Clone)]
pub struct UpstreamConnector(pub HttpConnector);

type Connecting =
    Pin<Box<dyn Future<Output = Result<TokioIo<QuickAck>, Box<dyn std::error::Error + Send + Sync>>> + Send>>;

impl tower::Service<Uri> for UpstreamConnector {
    type Response = TokioIo<QuickAck>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = Connecting;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower::Service::<Uri>::poll_ready(&mut self.0, cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = tower::Service::<Uri>::call(&mut self.0, uri);
        Box::pin(async move {
            let stream = QuickAck(connecting.await?.into_inner());
            stream.rearm();
            Ok(TokioIo::new(stream))
        })
    }
}
