package store

// PendingSessionWorkSQL exposes PendingSessionWork's query to the plan test.
const PendingSessionWorkSQL = pendingSessionWorkSQL
