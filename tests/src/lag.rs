//! A TCP relay that holds back everything the server sends by a fixed delay, and passes what the
//! client sends at once: the API-server connection of a daemon whose pod watch lags behind the
//! kubelet's. Requests reach the server when they are made; answers and watch events arrive
//! `delay` late, in order.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A running relay; stops when dropped.
#[derive(Debug)]
pub struct Lag {
    /// Where clients connect.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Lag {
    /// Relays connections to `upstream`, holding back its answers by `delay`.
    ///
    /// # Errors
    /// If no local port can be bound.
    pub async fn start(upstream: SocketAddr, delay: Duration) -> anyhow::Result<Lag> {
        let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the lag relay")?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(relay(client, upstream, delay));
            }
        });
        Ok(Lag { addr, task })
    }

    /// The relay as an `http://` URL.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Lag {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(client: TcpStream, upstream: SocketAddr, delay: Duration) {
    let Ok(server) = TcpStream::connect(upstream).await else { return };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let (held, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let requests = async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
        let _ = server_write.shutdown().await;
    };
    let answers = async move {
        let mut buf = vec![0; 64 * 1024];
        while let Ok(n) = server_read.read(&mut buf).await {
            if n == 0 || held.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let delivery = async move {
        while let Some((at, bytes)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if client_write.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(requests, answers, delivery);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn answers_arrive_late_and_in_order() {
        let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = server.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = server.accept().await.unwrap();
            let mut buf = [0; 4];
            s.read_exact(&mut buf).await.unwrap();
            s.write_all(b"one ").await.unwrap();
            s.write_all(b"two").await.unwrap();
        });
        let lag = Lag::start(upstream, Duration::from_millis(300)).await.unwrap();
        let mut c = TcpStream::connect(lag.addr).await.unwrap();
        let asked = Instant::now();
        c.write_all(b"ping").await.unwrap();
        let mut got = String::new();
        c.read_to_string(&mut got).await.unwrap();
        assert_eq!(got, "one two");
        assert!(asked.elapsed() >= Duration::from_millis(300), "{:?}", asked.elapsed());
    }
}
