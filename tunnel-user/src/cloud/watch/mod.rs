//! What a Kubernetes watch has seen: the Node and EndpointSlice watches
//! (`cloud::kubernetes`) and the CSR approver (`cloud::edges::csr`) keep one each. A
//! ground floor of the cloud.

use std::collections::HashMap;

use kube::ResourceExt;
use kube::runtime::watcher::Event;

/// The objects a watch has seen, by name, reduced to what we keep of them.
#[derive(Debug)]
pub(crate) struct Snapshot<T> {
    current: HashMap<String, T>,
    /// Filled during a (re)list; replaces `current` when the list is complete.
    relisting: Option<HashMap<String, T>>,
}

impl<T: PartialEq + Clone> Snapshot<T> {
    pub(crate) fn new() -> Self {
        Self {
            current: HashMap::new(),
            relisting: None,
        }
    }

    pub(crate) fn current(&self) -> &HashMap<String, T> {
        &self.current
    }

    /// Applies a watch event; says whether the current state changed.
    pub(crate) fn apply<K: ResourceExt>(
        &mut self,
        event: Event<K>,
        extract: impl Fn(&K) -> T,
    ) -> bool {
        match event {
            Event::Init => {
                self.relisting = Some(HashMap::new());
                false
            }
            Event::InitApply(obj) => {
                self.relisting
                    .get_or_insert_with(HashMap::new)
                    .insert(obj.name_any(), extract(&obj));
                false
            }
            Event::InitDone => {
                let listed = self.relisting.take().unwrap_or_default();
                let changed = listed != self.current;
                self.current = listed;
                changed
            }
            Event::Apply(obj) => {
                let value = extract(&obj);
                self.current.insert(obj.name_any(), value.clone()).as_ref() != Some(&value)
            }
            Event::Delete(obj) => self.current.remove(&obj.name_any()).is_some(),
        }
    }
}

impl<T: PartialEq + Clone> Default for Snapshot<T> {
    fn default() -> Self {
        Self::new()
    }
}
