//! A kubelet stand-in that speaks the real device plugin protocol: it serves `Registration`
//! on `<dir>/kubelet.sock`, and on `Register` does what the kubelet does — dials the plugin's
//! socket back, calls `GetDevicePluginOptions`, and streams `ListAndWatch` with the kubelet's
//! 4 MiB receive limit. [`Kubelet::admit`] admits a pod's containers in order the way the
//! kubelet's device manager does: `GetPreferredAllocation` over the healthy devices not in
//! use, then `Allocate` of the devices chosen.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, bail};
use gpushare_proto::deviceplugin::device_plugin_client::DevicePluginClient;
use gpushare_proto::deviceplugin::registration_server::{Registration, RegistrationServer};
use gpushare_proto::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Device, DevicePluginOptions, Empty,
    PreferredAllocationRequest, RegisterRequest,
};
use gpushare_proto::{DEVICE_PLUGIN_VERSION, HEALTHY};
use prost::Message as _;
use tokio::sync::watch;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// The kubelet's gRPC receive limit.
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// What the stand-in knows of the registered plugin.
#[derive(Debug, Default)]
struct Shared {
    registrations: Vec<RegisterRequest>,
    options: Option<DevicePluginOptions>,
    client: Option<DevicePluginClient<Channel>>,
    largest_message: usize,
    stream_errors: Vec<String>,
}

#[derive(Debug, Clone)]
struct Service {
    dir: PathBuf,
    shared: Arc<Mutex<Shared>>,
    devices: Arc<watch::Sender<Vec<Device>>>,
}

#[tonic::async_trait]
impl Registration for Service {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let r = request.into_inner();
        if r.version != DEVICE_PLUGIN_VERSION {
            return Err(Status::unknown(format!("unsupported device plugin version {:?}", r.version)));
        }
        if !r.resource_name.contains('/') || r.resource_name.starts_with("kubernetes.io/") {
            return Err(Status::unknown(format!("invalid extended resource name {:?}", r.resource_name)));
        }
        // As the kubelet: dial the plugin back (10 s), ask its options, then watch devices.
        let socket = self.dir.join(&r.endpoint);
        let channel = tokio::time::timeout(Duration::from_secs(10), gpushare_proto::uds::connect(&socket))
            .await
            .map_err(|_| Status::unknown(format!("timed out dialling {}", socket.display())))?
            .map_err(|e| Status::unknown(format!("cannot dial {}: {e}", socket.display())))?;
        let mut client = DevicePluginClient::new(channel).max_decoding_message_size(MAX_MESSAGE);
        let options = client.get_device_plugin_options(Empty {}).await?.into_inner();
        let mut stream = client.list_and_watch(Empty {}).await?.into_inner();
        {
            let mut shared = self.shared.lock().map_err(|_| Status::internal("poisoned"))?;
            shared.registrations.push(r);
            shared.options = Some(options);
            shared.client = Some(client);
        }
        let (shared, devices) = (Arc::clone(&self.shared), Arc::clone(&self.devices));
        tokio::spawn(async move {
            loop {
                match stream.message().await {
                    Ok(Some(list)) => {
                        let len = list.encoded_len();
                        if let Ok(mut s) = shared.lock() {
                            s.largest_message = s.largest_message.max(len);
                        }
                        devices.send_replace(list.devices);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        if let Ok(mut s) = shared.lock() {
                            s.stream_errors.push(e.to_string());
                        }
                        break;
                    }
                }
            }
        });
        Ok(Response::new(Empty {}))
    }
}

/// A running kubelet stand-in.
#[derive(Debug)]
pub struct Kubelet {
    dir: PathBuf,
    shared: Arc<Mutex<Shared>>,
    devices: watch::Receiver<Vec<Device>>,
    in_use: Mutex<HashSet<String>>,
    server: tokio::task::JoinHandle<()>,
}

/// One container's answer from the plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The devices the kubelet gave it.
    pub devices: Vec<String>,
    /// The environment the plugin returned.
    pub envs: BTreeMap<String, String>,
}

impl Kubelet {
    /// Serves `Registration` on `<dir>/kubelet.sock` (replacing a stale socket).
    ///
    /// # Errors
    /// If the socket cannot be bound.
    pub async fn start(dir: &Path) -> anyhow::Result<Kubelet> {
        let sock = dir.join("kubelet.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = tokio::net::UnixListener::bind(&sock).with_context(|| format!("binding {}", sock.display()))?;
        let (tx, devices) = watch::channel(Vec::new());
        let shared = Arc::new(Mutex::new(Shared::default()));
        let service = Service { dir: dir.to_owned(), shared: Arc::clone(&shared), devices: Arc::new(tx) };
        let server = tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(service))
                .serve_with_incoming(incoming)
                .await;
        });
        Ok(Kubelet { dir: dir.to_owned(), shared, devices, in_use: Mutex::default(), server })
    }

    /// The device-plugin directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Every registration accepted so far.
    #[must_use]
    pub fn registrations(&self) -> Vec<RegisterRequest> {
        self.shared().registrations.clone()
    }

    /// The plugin's options as read at registration.
    #[must_use]
    pub fn options(&self) -> Option<DevicePluginOptions> {
        self.shared().options
    }

    /// The largest `ListAndWatch` message received, in bytes.
    #[must_use]
    pub fn largest_message(&self) -> usize {
        self.shared().largest_message
    }

    /// Errors that ended a `ListAndWatch` stream (a message over the limit shows here).
    #[must_use]
    pub fn stream_errors(&self) -> Vec<String> {
        self.shared().stream_errors.clone()
    }

    /// Waits until `n` registrations have been accepted.
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_registered(&self, n: usize, timeout: Duration) -> anyhow::Result<RegisterRequest> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(r) = self.shared().registrations.get(n.saturating_sub(1)).cloned() {
                return Ok(r);
            }
            if tokio::time::Instant::now() > deadline {
                bail!("no registration #{n} within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for a device list that satisfies `ok`.
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_devices(&self, timeout: Duration, ok: impl Fn(&[Device]) -> bool) -> anyhow::Result<Vec<Device>> {
        let mut rx = self.devices.clone();
        let result = tokio::time::timeout(timeout, rx.wait_for(|d| ok(d))).await;
        match result {
            Ok(Ok(d)) => Ok(d.clone()),
            _ => bail!("no matching device list within {timeout:?} (last had {} devices)", self.devices.borrow().len()),
        }
    }

    /// The latest device list.
    #[must_use]
    pub fn devices(&self) -> Vec<Device> {
        self.devices.borrow().clone()
    }

    fn client(&self) -> anyhow::Result<DevicePluginClient<Channel>> {
        self.shared().client.clone().context("no plugin has registered")
    }

    /// Admits one pod: for each container (init containers first), in order, asks the plugin
    /// for a preferred allocation of `units` devices among the healthy devices not in use, and
    /// allocates them, as the kubelet's device manager does.
    ///
    /// # Errors
    /// The plugin's refusal, with its message.
    pub async fn admit(&self, containers: &[usize]) -> anyhow::Result<Vec<Admitted>> {
        let mut out = Vec::with_capacity(containers.len());
        for &units in containers {
            let devices = self.preferred(units).await?;
            let envs = self.allocate(&devices).await?;
            out.push(Admitted { devices, envs });
        }
        Ok(out)
    }

    /// `GetPreferredAllocation` for `units` devices among the healthy devices not in use.
    ///
    /// # Errors
    /// The plugin's refusal.
    pub async fn preferred(&self, units: usize) -> anyhow::Result<Vec<String>> {
        let available: Vec<String> = {
            let in_use = self.in_use.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            self.devices()
                .into_iter()
                .filter(|d| d.health == HEALTHY && !in_use.contains(&d.id))
                .map(|d| d.id)
                .collect()
        };
        if available.len() < units {
            bail!("only {} devices free, {units} requested", available.len());
        }
        let response = self
            .client()?
            .get_preferred_allocation(PreferredAllocationRequest {
                container_requests: vec![ContainerPreferredAllocationRequest {
                    available_device_i_ds: available,
                    must_include_device_i_ds: vec![],
                    allocation_size: i32::try_from(units)?,
                }],
            })
            .await
            .map_err(|s| anyhow::anyhow!("GetPreferredAllocation: {}: {}", code(&s), s.message()))?
            .into_inner();
        let ids = response.container_responses.into_iter().next().map(|r| r.device_i_ds).unwrap_or_default();
        if ids.len() != units {
            bail!("the plugin proposed {} devices for {units}", ids.len());
        }
        Ok(ids)
    }

    /// `GetDevicePluginOptions`, asked of the plugin now (the cheapest call: what a round trip
    /// costs).
    ///
    /// # Errors
    /// No plugin has registered, or the call failed.
    pub async fn ask_options(&self) -> anyhow::Result<DevicePluginOptions> {
        let response = self
            .client()?
            .get_device_plugin_options(Empty {})
            .await
            .map_err(|s| anyhow::anyhow!("GetDevicePluginOptions: {}: {}", code(&s), s.message()))?;
        Ok(response.into_inner())
    }

    /// `Allocate` of these devices; on success they are in use.
    ///
    /// # Errors
    /// The plugin's refusal.
    pub async fn allocate(&self, devices: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
        let response = self
            .client()?
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest { devices_ids: devices.to_vec() }],
            })
            .await
            .map_err(|s| anyhow::anyhow!("Allocate: {}: {}", code(&s), s.message()))?
            .into_inner();
        let envs = response.container_responses.into_iter().next().context("empty Allocate response")?.envs;
        self.in_use.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend(devices.iter().cloned());
        Ok(envs.into_iter().collect())
    }

    /// Stops serving and removes `kubelet.sock`.
    pub fn stop(self) {
        self.server.abort();
        let _ = std::fs::remove_file(self.dir.join("kubelet.sock"));
    }
}

fn code(s: &Status) -> String {
    format!("{:?}", s.code())
}
