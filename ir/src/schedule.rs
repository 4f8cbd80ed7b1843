//! Pipeline schedules as data (placeholder until the schedule work lands).
