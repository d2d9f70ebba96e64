#pragma once
// The store an ECX configuration names (store_url, store_prefix, store_model, ...).

#include <memory>

#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/status.h"
#include "ecx/store/embedding_store.h"
#include "ecx/store/mooncake_store.h"
#include "ecx/store/presence_index.h"
#include "ecx/store/publisher.h"

namespace ecx::store {

// redis://[[user]:password@]host[:port][/db]; errors name store_url and the form.
Result<RedisOptions> redis_options(const Config& config, std::shared_ptr<const Clock> clock = nullptr);
// mooncake://<master host:port>?metadata=<url>[&local_hostname=..][&protocol=..][&device=..];
// the library comes from $ECX_MOONCAKE_STORE_LIB (else the loader's search path).
Result<MooncakeStoreOptions> mooncake_options(const Config& config, std::shared_ptr<const Clock> clock = nullptr);
// Parses store_url (either backend) and the key space without connecting: what
// open_store would refuse, with the same messages.
Status check_store_url(const Config& config);
// One store object (one connection) for config's store.
Result<std::unique_ptr<EmbeddingStore>> open_store(const Config& config, std::shared_ptr<const Clock> clock = nullptr);
// The scheduler's presence index: its own lookup connection and the store's change feed.
Result<std::unique_ptr<PresenceIndex>> open_presence_index(const Config& config,
                                                           std::shared_ptr<const Clock> clock = nullptr);
PublisherOptions publisher_options(const Config& config);

}  // namespace ecx::store
